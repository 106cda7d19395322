"""plan.memory_trace.LiveBytes: counts allocations and frees exactly; a fake trace agrees with the real run."""

import torch

from adaptercl.plan.memory_trace import LiveBytes, fake_mode, fakeify


def step(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).square().sum().backward()


def test_counts_allocations_and_frees():
    with LiveBytes() as tracker:
        a = torch.ones(1000)  # 4,000 bytes
        b = torch.ones(500, dtype=torch.float64)  # 4,000 bytes
        view = a[:10]  # same storage: not counted again
        assert tracker.total == 8000
        del a, view
        assert tracker.total == 4000
        del b
    assert tracker.total == 0
    assert tracker.peak == 8000


def test_logits_category_by_vocab():
    with LiveBytes(vocab=7) as tracker:
        logits = torch.zeros(3, 7)
        assert tracker.now["logits"] == 3 * 7 * 4
        del logits


def test_fake_trace_matches_real_run():
    torch.manual_seed(0)
    real_model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x = torch.randn(16, 32)
    real = LiveBytes()
    for p in real_model.parameters():
        real.register(p, "weights")
    with real:
        step(real_model, x)
    with torch.device("meta"):
        meta_model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    mode = fake_mode()
    fakeify(meta_model, mode)
    fake = LiveBytes(assume_data=True)
    for p in meta_model.parameters():
        fake.register(p, "weights")
    with mode, fake:
        step(meta_model, x)
        assert bool(torch.zeros(1).sum() > 0) is True  # data-dependent reads answered, not failing
    assert fake.peak == real.peak
    assert fake.peak > sum(p.numel() * 4 for p in real_model.parameters())
