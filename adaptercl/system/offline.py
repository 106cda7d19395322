"""What to tell the user when a hub model, a hub dataset or a data URL cannot be had: one line naming it, the error's
first line, and the offline settings that decide whether the network is tried.

`HF_HUB_OFFLINE=1` keeps `huggingface_hub` and `transformers` to the local cache, and `datasets` too: with it set,
`datasets` refuses plain http(s) data files as well (`OfflineModeIsEnabled`), not only hub datasets.
`HF_DATASETS_OFFLINE=0` next to it lets `datasets` fetch URL and hub data while models stay cache-only (datasets
reads it once, at import). No torch import.
"""

from __future__ import annotations

import os

TRUE_VALUES = {"1", "ON", "YES", "TRUE"}


def env_on(name: str) -> bool:
    return os.environ.get(name, "").upper() in TRUE_VALUES


def is_network_failure(err: BaseException) -> bool:
    """Errors that mean 'could not fetch it': OS/connection errors and the hub client's own errors."""
    module = type(err).__module__
    return isinstance(err, OSError) or module.startswith(("huggingface_hub", "httpx", "requests", "fsspec"))


def first_line(err: BaseException, limit: int = 200) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def hub_model_message(name: str, err: BaseException) -> str:
    """`model.name`: a hub model that could not be loaded."""
    if env_on("HF_HUB_OFFLINE"):
        hint = "HF_HUB_OFFLINE=1 is set and it is not in the local cache: unset HF_HUB_OFFLINE to download it"
    else:
        hint = (
            "the hub did not give it and it is not in the local cache: check the id and the network (with "
            "HF_HUB_OFFLINE=1 only the cache is read)"
        )
    return f"model.name: cannot load hub model {name!r}: {hint} ({first_line(err)})"


def dataset_message(where: str, what: str, err: BaseException) -> str:
    """`domains.X.source`: a hub dataset or data URL that could not be loaded by `datasets`."""
    import datasets

    if datasets.config.HF_HUB_OFFLINE:  # HF_HUB_OFFLINE=1, unless HF_DATASETS_OFFLINE=0 overrides it for datasets
        hint = (
            "datasets is offline (HF_HUB_OFFLINE=1) and has no cached copy: unset HF_HUB_OFFLINE, or set "
            "HF_DATASETS_OFFLINE=0 to fetch data while models stay offline"
        )
    elif is_network_failure(err):
        hint = "check the name and the network (HF_HUB_OFFLINE=1 reads only the cache)"
    else:
        hint = "check the name, subset and split"
    return f"{where}: cannot load {what}: {hint} ({first_line(err)})"
