"""Survival predictors (docs/METHODS.md §7): trace loading, training, save/load, normalization.

Synthetic traces: acceptance is a known function of one scalar feature. Each round draws
``u ~ U(0, 1)``, shown at every position as scalar 0, and accepts ``L = floor(u (block + 1))``
draft tokens; scalar 15 carries the block position. So ``1{L >= j} = 1{u >= j / (block + 1)}``
is learnable from two scalars, while a position-only predictor sees only the rate at j.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from vllm_prove.core.survival import fold_assignment, rotation, survival_labels
from vllm_prove.errors import ProveError
from vllm_prove.train.survival import (
    NUM_SCALARS,
    SurvivalMLP,
    SurvivalTraces,
    block_scores,
    load_predictor,
    load_traces,
    save_predictor,
    train_survival,
)

BLOCK, HIDDEN, NUM_BLOCKS, NUM_PROMPTS = 8, 8, 1000, 100
SIGNAL_SCALAR, POSITION_SCALAR, FOLD_SCALAR = 0, 15, 18


def _synthetic_traces(num_blocks: int = NUM_BLOCKS, seed: int = 0) -> SurvivalTraces:
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(num_blocks, generator=gen)  # [batch]
    accepted = (u * (BLOCK + 1)).floor().clamp(max=BLOCK).to(torch.int64)  # [batch]
    prompt_id = torch.arange(num_blocks) % NUM_PROMPTS  # [batch]
    scalars = torch.randn(num_blocks, BLOCK, NUM_SCALARS, generator=gen)  # [batch, block, 19]
    scalars[:, :, SIGNAL_SCALAR] = u[:, None]
    scalars[:, :, POSITION_SCALAR] = torch.arange(BLOCK) / BLOCK
    # a feature whose mean differs across folds, so stats over the wrong folds are visible
    scalars[:, :, FOLD_SCALAR] = 100.0 * fold_assignment(prompt_id)[:, None]
    return SurvivalTraces(
        hidden=torch.randn(num_blocks, BLOCK, HIDDEN, generator=gen),
        scalars=scalars,
        accepted=accepted,
        num_draft_tokens=torch.full((num_blocks,), BLOCK),
        prompt_id=prompt_id,
        confidence=torch.rand(num_blocks, BLOCK, generator=gen),
        scalar_names=tuple(f"s{i}" for i in range(NUM_SCALARS)),
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    traces = _synthetic_traces()
    out = tmp_path_factory.mktemp("survival")
    # One intra-op thread: a small MLP gains nothing from more, and on a shared CPU two
    # threads ran this fixture 20x slower (oversubscription).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reports = {
            signal: train_survival(traces, signal, out, epochs=8, batch_tokens=256, device="cpu",
                                   progress=False)
            for signal in ("marginal", "conditional")
        }
    finally:
        torch.set_num_threads(threads)
    return traces, out, reports


@pytest.mark.slow
@pytest.mark.parametrize("signal", ["marginal", "conditional"])
def test_predictor_beats_position_baseline(trained, signal):
    _, _, reports = trained
    report = reports[signal]
    assert len(report.rotations) == 5
    # the position-only rate leaves u unexplained: BCE ~ 0.5; the MLP reads u
    assert report.mean_baseline_test_bce > 0.3
    assert report.mean_test_bce < 0.5 * report.mean_baseline_test_bce
    assert report.auroc > 0.9
    scored = [a for a in report.per_position_auroc if a is not None]
    assert len(scored) == BLOCK and min(scored) > 0.8


def test_baseline_is_the_training_folds_rate_per_position(trained):
    traces, _, reports = trained
    labels, mask = survival_labels(traces.accepted, traces.num_draft_tokens, BLOCK, "marginal")
    fold = fold_assignment(traces.prompt_id)  # [batch]
    rot = rotation(0)
    train_rows = torch.isin(fold, torch.tensor(rot.train))  # [batch]
    test_rows = fold == rot.test  # [batch]
    rate = labels[train_rows].double().mean(dim=0)  # [block]: all positions valid here
    expected = F.binary_cross_entropy(rate.expand(int(test_rows.sum()), BLOCK),
                                      labels[test_rows].double())
    got = reports["marginal"].rotations[0]
    assert got.baseline_test_bce == pytest.approx(float(expected), rel=1e-9)
    assert got.num_train_tokens == int(mask[train_rows].sum())
    assert (got.train_folds, got.validation_fold, got.test_fold) == ([2, 3, 4], 1, 0)


def test_normalization_stats_come_from_training_folds_only(trained):
    traces, out, reports = trained
    fold = fold_assignment(traces.prompt_id)  # [batch]
    for signal in ("marginal", "conditional"):
        _, mask = survival_labels(traces.accepted, traces.num_draft_tokens, BLOCK, signal)
        final = reports[signal].final
        train_rows = torch.isin(fold, torch.tensor(final["train_folds"]))[:, None] & mask
        features = torch.cat([traces.hidden, traces.scalars], dim=-1)  # [batch, block, in]
        expected_mean = features[train_rows].double().mean(0).float()  # [in_features]
        expected_std = features[train_rows].double().std(0, unbiased=False).float()
        saved = torch.load(out / f"{signal}.pt", weights_only=True)
        assert torch.allclose(saved["normalization"]["mean"], expected_mean, atol=1e-5)
        assert torch.allclose(saved["normalization"]["std"], expected_std, rtol=1e-4)
        # stats over all tokens differ (the fold feature): the check above can fail
        all_mean = features[mask].double().mean(0).float()
        assert abs(all_mean[HIDDEN + FOLD_SCALAR] - expected_mean[HIDDEN + FOLD_SCALAR]) > 10
        assert final["validation_fold"] not in final["train_folds"]


def test_saved_predictor_round_trip(trained):
    traces, out, reports = trained
    for signal in ("marginal", "conditional"):
        saved = torch.load(out / f"{signal}.pt", weights_only=True)
        assert saved["signal"] == signal
        assert saved["in_features"] == HIDDEN + NUM_SCALARS == len(saved["feature_names"])
        assert saved["feature_names"][HIDDEN:] == list(traces.scalar_names)
        loaded = load_predictor(out / f"{signal}.pt")
        assert not loaded.training
        hidden = traces.hidden[:16].reshape(-1, HIDDEN)  # [num_tokens, hidden]
        scalars = traces.scalars[:16].reshape(-1, NUM_SCALARS)  # [num_tokens, 19]
        with torch.no_grad():
            assert torch.equal(loaded(hidden, scalars), reports[signal].predictor(hidden, scalars))
    report_json = json.loads((out / "report.json").read_text())
    assert set(report_json) == {"marginal", "conditional"}  # the second run did not overwrite
    assert report_json["marginal"]["mean_test_bce"] == reports["marginal"].mean_test_bce


def test_load_predictor_applies_stored_normalization(tmp_path):
    torch.manual_seed(0)
    model = SurvivalMLP(HIDDEN).eval()
    model.feature_mean.uniform_(-3, 3)
    model.feature_std.uniform_(0.5, 4)
    save_predictor(model, tmp_path / "p.pt", "conditional")
    loaded = load_predictor(tmp_path / "p.pt")
    hidden, scalars = torch.randn(5, HIDDEN), torch.randn(5, NUM_SCALARS)
    x = torch.cat([hidden, scalars], -1)  # [num_tokens, in_features]
    with torch.no_grad():
        by_hand = torch.sigmoid(model.net((x - model.feature_mean) / model.feature_std))[:, 0]
        unnormalized = torch.sigmoid(model.net(x))[:, 0]
        assert torch.allclose(loaded(hidden, scalars), by_hand)
        assert not torch.allclose(loaded(hidden, scalars), unnormalized, atol=1e-3)


def test_block_scores_shape_and_eval_mode():
    torch.manual_seed(0)
    model = SurvivalMLP(HIDDEN).train()  # dropout on: block_scores must turn it off
    hidden, scalars = torch.randn(3, BLOCK, HIDDEN), torch.randn(3, BLOCK, NUM_SCALARS)
    q = block_scores(model, hidden, scalars)  # [batch, block]
    assert q.shape == (3, BLOCK) and ((q > 0) & (q < 1)).all()
    assert torch.equal(q, block_scores(model, hidden, scalars))  # deterministic
    model.eval()
    with torch.no_grad():
        flat = model(hidden.reshape(-1, HIDDEN), scalars.reshape(-1, NUM_SCALARS))
    assert torch.equal(q, flat.view(3, BLOCK))
    assert model.training is False  # restored to the mode it had (eval here)


def test_load_traces_file_and_folder(tmp_path):
    traces = _synthetic_traces(num_blocks=12)
    as_dict = {k: getattr(traces, k) for k in ("hidden", "scalars", "accepted",
                                               "num_draft_tokens", "prompt_id", "confidence")}
    torch.save({**as_dict, "scalar_names": list(traces.scalar_names)}, tmp_path / "one.pt")
    single = load_traces(tmp_path / "one.pt")
    assert torch.equal(single.hidden, traces.hidden) and single.scalar_names == traces.scalar_names
    folder = tmp_path / "parts"
    folder.mkdir()
    torch.save({k: v[:5] for k, v in as_dict.items()}, folder / "a.pt")
    torch.save({k: v[5:] for k, v in as_dict.items()}, folder / "b.pt")
    joined = load_traces(folder)
    assert torch.equal(joined.accepted, traces.accepted)  # rows in file-name order
    assert torch.equal(joined.scalars, traces.scalars) and joined.scalar_names is None
    torch.save({k: v for k, v in as_dict.items() if k != "prompt_id"}, tmp_path / "bad.pt")
    with pytest.raises(ProveError, match="prompt_id"):
        load_traces(tmp_path / "bad.pt")
    with pytest.raises(ProveError, match="scalars"):
        SurvivalTraces(**{**as_dict, "scalars": traces.scalars[..., :18]})
    with pytest.raises(ProveError, match="epochs"):
        train_survival(SurvivalTraces.make_dummy(), "marginal", tmp_path, epochs=0)
