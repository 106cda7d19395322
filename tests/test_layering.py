"""The package's floors, as a test: adaptercl/ is folders by layer, read bottom-up (README "Layout").

The rules, on the import graph of adaptercl/**/*.py (every import statement, function-local ones included):

1. Floors. A module imports only from its own folder and from the folders of lower floors (`FLOORS`, bottom-up).
   The top-level modules (the lazy API, the command line and its console) are the top floor, one unit. No import
   points up, and none sideways to another folder of the same floor.
2. Faces. Outside folder F, code imports F only through F's `__init__.py`: `from adaptercl.F import name` with
   `name` in the face's `_EXPORTS`, never `adaptercl.F.<module>` itself. Inside F, modules import each other by
   their full path. An exported name equal to its module's name exports the module whole (a namespace, as
   `from adaptercl.system import distributed`); any other name may not be a module's name, because importing that
   module would put the module where the lazy face's name should be.
3. The grammar is torch-free. Nothing `recipe/` imports, directly or through other adaptercl modules, imports
   torch, transformers or peft, and importing every module of `recipe/` in a fresh interpreter leaves all three out
   of `sys.modules`.

Tests and benchmarks may import any module (a test imports the module it tests); the rules are the package's.
The checks are plain functions of a source tree, so the last tests run them on small trees that break each rule.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# bottom-up; a folder's modules may import from the folders of the floors below it, and from their own folder
FLOORS: list[tuple[str, ...]] = [
    ("recipe",),  # the grammar: torch-free
    ("system",),  # atomic files, processes, offline messages (RecipeError from the grammar)
    ("model", "domains"),
    ("adapters",),  # named LoRA adapters on the model (which layers: the model's lora_layers)
    ("rollout", "teacher"),
    ("run_dir", "plan"),
    ("measure", "ship"),
    ("train",),
    ("run",),
    ("adaptercl",),  # the top-level modules: the Python API (__init__.py), the command line and its console
]
TORCH_FREE = "recipe"
HEAVY = ("torch", "transformers", "peft")


# ---------------------------------------------------------------------------------------------- the graph


def modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module under root/adaptercl (a package's is its __init__.py)."""
    out = {}
    for path in sorted((root / "adaptercl").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def unit(module: str, mods: dict[str, Path]) -> str:
    """The folder of a module (`adaptercl.train.stage` -> train; a face is its folder's), or `adaptercl` for the
    top-level modules."""
    parts = module.split(".")
    return parts[1] if len(parts) >= 3 or (len(parts) == 2 and is_face(module, mods)) else "adaptercl"


def is_face(module: str, mods: dict[str, Path]) -> bool:
    return len(module.split(".")) == 2 and mods[module].name == "__init__.py"


def face_exports(path: Path) -> dict[str, str]:
    """A face's `_EXPORTS` literal: exported name -> the folder's module that defines it (its name in the folder)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names) of every absolute import in the file; names is [] for `import x`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module, [a.name for a in node.names]))
    return out


def adaptercl_edges(root: Path) -> list[tuple[str, str, int, str]]:
    """(importer, imported module, line, how) for every import of an adaptercl module, names resolved to the module
    that defines them: `from adaptercl.F import name` through F's face, `from adaptercl import name` to a module."""
    mods, edges = modules(root), []
    for importer, path in mods.items():
        for line, module, names in imports(path):
            if not module.startswith("adaptercl"):
                continue
            if module not in mods:
                edges.append((importer, module, line, "missing"))
            elif names and is_face(module, mods):
                exports = face_exports(mods[module])
                for name in names:
                    if f"{module}.{name}" in mods:
                        edges.append((importer, f"{module}.{name}", line, f"face:{name}"))
                    else:
                        target = f"{module}.{exports[name]}" if name in exports else module
                        edges.append(
                            (importer, target, line, f"face:{name}" if name in exports else f"unexported:{name}")
                        )
            elif names and module == "adaptercl":
                edges.extend((importer, f"adaptercl.{n}", line, "module") for n in names if f"adaptercl.{n}" in mods)
            else:
                edges.append((importer, module, line, "direct"))
    return edges


def floor_of(name: str) -> int:
    """1 for the bottom floor (the README's numbering)."""
    return next(i for i, floor in enumerate(FLOORS, start=1) if name in floor)


# ---------------------------------------------------------------------------------------------- the rules


def unplaced(root: Path) -> list[str]:
    """Folders and top-level modules of the package that no floor names."""
    placed, mods = {u for floor in FLOORS for u in floor}, modules(root)
    return sorted({unit(m, mods) for m in mods} - placed)


def upward_imports(root: Path) -> list[str]:
    """Imports of a folder from the same or a higher floor (other than the importer's own folder)."""
    bad, mods = [], modules(root)
    for importer, target, line, _ in adaptercl_edges(root):
        a, b = unit(importer, mods), unit(target, mods) if target in mods else "adaptercl"
        if a != b and floor_of(b) >= floor_of(a):
            bad.append(f"{importer}:{line} imports {target} ({b}, floor {floor_of(b)} >= {a}'s {floor_of(a)})")
    return bad


def private_imports(root: Path) -> list[str]:
    """Imports of another folder's module other than through that folder's face, or of a name it does not
    export."""
    mods, bad = modules(root), []
    for importer, target, line, how in adaptercl_edges(root):
        if target not in mods:
            bad.append(f"{importer}:{line} imports {target}, which is not a module")
            continue
        a, b = unit(importer, mods), unit(target, mods)
        if a == b or b == "adaptercl":
            continue
        if how == "direct" and not is_face(target, mods) or how == "module":
            bad.append(f"{importer}:{line} imports {target} directly; import its names from adaptercl.{b}")
        elif how.startswith("unexported:"):
            bad.append(f"{importer}:{line} imports {how.split(':')[1]}, which adaptercl.{b}'s face does not export")
        elif how.startswith("face:") and how.split(":")[1] not in face_exports(mods[f"adaptercl.{b}"]):
            bad.append(f"{importer}:{line} imports module {target} through the face, which does not export it")
    return bad


def defined_names(path: Path) -> set[str]:
    """Names bound at the top level of a module (definitions, assignments, imports)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def broken_faces(root: Path) -> list[str]:
    """Exports naming a module that does not exist or does not define the name, and names that shadow a module."""
    mods, bad = modules(root), []
    for folder, path in mods.items():
        if not is_face(folder, mods):
            continue
        for name, module in face_exports(path).items():
            full = f"{folder}.{module}"
            if full not in mods:
                bad.append(f"{folder} exports {name} from {module}, which is not a module of the folder")
            elif name != module and name not in defined_names(mods[full]):
                bad.append(f"{folder} exports {name} from {module}, which does not define it")
            elif name != module and f"{folder}.{name}" in mods:
                bad.append(f"{folder} exports {name} from {module}, but {folder}.{name} is a module: rename one")
    return bad


def heavy_imports_of(root: Path, folder: str) -> list[str]:
    """Third-party heavy imports reachable from `folder`'s modules through adaptercl imports (static closure)."""
    mods = modules(root)
    by_importer: dict[str, list[str]] = {}
    for importer, target, _, _ in adaptercl_edges(root):
        by_importer.setdefault(importer, []).append(target)
    todo = [m for m in mods if unit(m, mods) == folder]
    seen, bad = set(todo), []
    while todo:
        module = todo.pop()
        for line, name, _ in imports(mods[module]):
            if name.split(".")[0] in HEAVY:
                bad.append(f"{module}:{line} imports {name}")
        for target in by_importer.get(module, []):
            if target in mods and target not in seen:
                seen.add(target)
                todo.append(target)
    return sorted(bad)


# ---------------------------------------------------------------------------------------------- the package


def test_every_folder_and_top_level_module_has_a_floor():
    assert unplaced(REPO) == []


def test_no_import_points_up_or_sideways():
    assert upward_imports(REPO) == []


def test_other_folders_are_imported_only_through_their_face():
    assert private_imports(REPO) == []


def test_every_face_exports_names_its_modules_define():
    assert broken_faces(REPO) == []


def test_the_grammar_imports_no_torch_transformers_or_peft():
    assert heavy_imports_of(REPO, TORCH_FREE) == []


def test_importing_the_grammar_loads_no_torch_transformers_or_peft():
    mods = modules(REPO)
    names = sorted(m for m in mods if unit(m, mods) == TORCH_FREE)
    code = f"import sys\nfor m in {names!r}: __import__(m)\nprint(sorted(set({HEAVY!r}) & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ------------------------------------------------------------------------------ the checks catch each break


def small_tree(tmp_path: Path, files: dict[str, str]) -> Path:
    """A package tree with a grammar, a model folder (face exports load_base) and a train folder."""
    base = {
        "adaptercl/__init__.py": "",
        "adaptercl/recipe/__init__.py": '_EXPORTS = {"RecipeConfig": "grammar"}\n',
        "adaptercl/recipe/grammar.py": "class RecipeConfig: ...\n",
        "adaptercl/model/__init__.py": '_EXPORTS = {"load_base": "base"}\n',
        "adaptercl/model/base.py": "from adaptercl.recipe import RecipeConfig\n\ndef load_base(): ...\n",
        "adaptercl/train/__init__.py": "_EXPORTS = {}\n",
        "adaptercl/train/stage.py": "from adaptercl.model import load_base\n",
    }
    for rel, text in {**base, **files}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_the_checks_pass_a_clean_small_tree(tmp_path):
    root = small_tree(tmp_path, {})
    assert upward_imports(root) == private_imports(root) == broken_faces(root) == []
    assert heavy_imports_of(root, "recipe") == []


def test_an_upward_import_is_caught_also_inside_a_function(tmp_path):
    root = small_tree(
        tmp_path, {"adaptercl/model/base.py": "def load_base():\n    from adaptercl.train import stage\n"}
    )
    assert upward_imports(root) == [
        "adaptercl.model.base:2 imports adaptercl.train.stage (train, floor 8 >= model's 3)"
    ]


def test_a_private_module_or_an_unexported_name_is_caught(tmp_path):
    root = small_tree(
        tmp_path,
        {
            "adaptercl/train/stage.py": "from adaptercl.model.base import load_base\n",
            "adaptercl/train/step.py": "from adaptercl.model import decoder_and_head\n",
        },
    )
    assert private_imports(root) == [
        "adaptercl.train.stage:1 imports adaptercl.model.base directly; import its names from adaptercl.model",
        "adaptercl.train.step:1 imports decoder_and_head, which adaptercl.model's face does not export",
    ]


def test_a_face_export_shadowed_by_a_module_or_missing_is_caught(tmp_path):
    root = small_tree(
        tmp_path,
        {
            "adaptercl/model/__init__.py": '_EXPORTS = {"load_base": "base", "base_fn": "base", "x": "nowhere"}\n',
            "adaptercl/model/base_fn.py": "",
            "adaptercl/model/base.py": "def load_base(): ...\ndef base_fn(): ...\n",
        },
    )
    assert broken_faces(root) == [
        "adaptercl.model exports base_fn from base, but adaptercl.model.base_fn is a module: rename one",
        "adaptercl.model exports x from nowhere, which is not a module of the folder",
    ]


def test_torch_reached_from_the_grammar_through_another_module_is_caught(tmp_path):
    root = small_tree(
        tmp_path,
        {
            "adaptercl/recipe/grammar.py": "from adaptercl.recipe.blocks import X\nclass RecipeConfig: ...\n",
            "adaptercl/recipe/blocks.py": "def X():\n    import torch\n",
        },
    )
    assert heavy_imports_of(root, "recipe") == ["adaptercl.recipe.blocks:2 imports torch"]
