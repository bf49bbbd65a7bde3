"""Survival predictors for verifier skipping in SDD (docs/METHODS.md §7, "Survival predictors").

One MLP per signal (``marginal``: ``a^_j ~ P(L >= j)``; ``conditional``: ``s^_j ~ P(L >= j |
L >= j - 1)``) reads, for draft position j of a round, the drafter's LM-head input vector at the
step that revealed token j and 19 scalars, and predicts the survival label of
``vllm_prove.core.survival.survival_labels``::

    features  concat(hidden [hidden], scalars [19])   standardized with training-fold stats
    network   in -> 256 -> 256 -> 256 -> 1, GELU, dropout 0.1 after the first two hidden layers
    training  BCE with logits, Adam lr 1e-3, 15 epochs, batches of 4,096 tokens,
              keep the epoch with the lowest validation BCE

Cross-validation: five folds by prompt id (``fold_assignment``, seed 12345); rotation r tests
fold r, validates on fold r + 1 mod 5 and trains on the other three.

Trace format (one ``torch.save`` file, or a folder of ``*.pt`` files concatenated along rows):
a dict with ``hidden`` float [batch, block, hidden], ``scalars`` float [batch, block, 19],
``accepted`` int64 [batch] (strict-SDD L), ``num_draft_tokens`` int64 [batch] (n),
``prompt_id`` int64 [batch], ``confidence`` float [batch, block] (raw confidence) and
optionally ``scalar_names`` (list of 19 str). Rows are rounds (blocks), columns positions.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from vllm_prove.core.metrics import auc
from vllm_prove.core.survival import (
    DEFAULT_NUM_FOLDS,
    FOLD_SEED,
    SurvivalSignal,
    fold_assignment,
    rotation,
    survival_labels,
)
from vllm_prove.errors import ProveError

NUM_SCALARS = 19  # the paper's scalar features (docs/METHODS.md §7)
HIDDEN_WIDTH = 256  # paper: in -> 256 -> 256 -> 256 -> 1
DROPOUT = 0.1  # paper: after the first two hidden layers
LR = 1e-3  # paper: Adam
EPOCHS = 15  # paper
BATCH_TOKENS = 4096  # paper: batches of 4,096 tokens
STD_FLOOR = 1e-6  # a constant feature (a dataset indicator) is centred, not divided by 0
PROB_FLOOR = 1e-6  # keeps the position-only baseline's log finite when a rate is 0 or 1
STATS_CHUNK = 65536  # tokens per chunk when computing normalization stats
# The user-facing predictor is refit on every fold but this one, which early-stops it
# (project choice: 4/5 of the prompts, against 3/5 for any single rotation).
FINAL_VALIDATION_FOLD = 0
TRACE_TENSORS = ("hidden", "scalars", "accepted", "num_draft_tokens", "prompt_id", "confidence")


@dataclass(frozen=True)
class SurvivalTraces:
    """Strict-SDD traces, one row per round (see the module docstring)."""

    hidden: torch.Tensor  # [batch, block, hidden] float: LM-head input at each reveal step
    scalars: torch.Tensor  # [batch, block, num_scalars] float
    accepted: torch.Tensor  # [batch] int64: L
    num_draft_tokens: torch.Tensor  # [batch] int64: n
    prompt_id: torch.Tensor  # [batch] int64
    confidence: torch.Tensor  # [batch, block] float: raw confidence
    scalar_names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.hidden.dim() != 3:
            raise ProveError(f"traces: hidden must be [batch, block, hidden], got "
                             f"{tuple(self.hidden.shape)}")
        batch, block = self.hidden.shape[:2]
        want = {"scalars": (batch, block, NUM_SCALARS), "accepted": (batch,),
                "num_draft_tokens": (batch,), "prompt_id": (batch,), "confidence": (batch, block)}
        for name, shape in want.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ProveError(f"traces: {name} has shape {got}, expected {shape}")
        names = self.scalar_names
        if names is not None and len(names) != NUM_SCALARS:
            raise ProveError(f"traces: scalar_names has {len(names)} names, expected {NUM_SCALARS}")

    @property
    def block(self) -> int:
        return self.hidden.shape[1]

    @classmethod
    def make_dummy(cls, batch: int = 10, block: int = 4, hidden: int = 8) -> SurvivalTraces:
        """Random features, L uniform in [0, block], one prompt per row."""
        n = torch.full((batch,), block, dtype=torch.int64)  # [batch]
        return cls(torch.randn(batch, block, hidden), torch.randn(batch, block, NUM_SCALARS),
                   torch.randint(0, block + 1, (batch,)), n, torch.arange(batch),
                   torch.rand(batch, block))


def load_traces(path: str | Path) -> SurvivalTraces:
    """Read one trace file, or every ``*.pt`` of a folder (sorted by name, rows concatenated)."""
    path = Path(path)
    files = sorted(path.glob("*.pt")) if path.is_dir() else [path]
    if not files or not files[0].exists():
        raise ProveError(f"traces: no trace file at {path} (a .pt file or a folder of them)")
    parts = [torch.load(f, map_location="cpu", weights_only=True) for f in files]
    for f, part in zip(files, parts):
        missing = [k for k in TRACE_TENSORS if k not in part]
        if missing:
            raise ProveError(f"traces: {f} lacks {missing}")
    names = {tuple(p["scalar_names"]) for p in parts if p.get("scalar_names") is not None}
    if len(names) > 1:
        raise ProveError(f"traces: the files of {path} disagree on scalar_names")
    tensors = {k: torch.cat([p[k] for p in parts]) for k in TRACE_TENSORS}
    return SurvivalTraces(**tensors, scalar_names=names.pop() if names else None)


class SurvivalMLP(nn.Module):
    """``in -> 256 -> 256 -> 256 -> 1`` on standardized ``concat(hidden, scalars)``."""

    def __init__(self, hidden_size: int, num_scalars: int = NUM_SCALARS) -> None:
        super().__init__()
        self.hidden_size, self.num_scalars = hidden_size, num_scalars
        in_features = hidden_size + num_scalars
        # buffers: saved in the state_dict, so inference applies the training normalization
        self.register_buffer("feature_mean", torch.zeros(in_features))  # [in_features]
        self.register_buffer("feature_std", torch.ones(in_features))  # [in_features]
        w = HIDDEN_WIDTH
        self.net = nn.Sequential(
            nn.Linear(in_features, w), nn.GELU(), nn.Dropout(DROPOUT),
            nn.Linear(w, w), nn.GELU(), nn.Dropout(DROPOUT),
            nn.Linear(w, w), nn.GELU(),
            nn.Linear(w, 1),
        )

    @property
    def in_features(self) -> int:
        return self.hidden_size + self.num_scalars

    def logits(
        self,
        # [num_tokens, hidden] float
        hidden: torch.Tensor,
        # [num_tokens, num_scalars] float
        scalars: torch.Tensor,
    ) -> torch.Tensor:  # [num_tokens] float32
        x = torch.cat([hidden.float(), scalars.float()], dim=-1)  # [num_tokens, in_features]
        return self.net((x - self.feature_mean) / self.feature_std).squeeze(-1)

    def forward(
        self,
        # [num_tokens, hidden] float
        hidden: torch.Tensor,
        # [num_tokens, num_scalars] float
        scalars: torch.Tensor,
    ) -> torch.Tensor:  # [num_tokens] float32: survival probability
        return torch.sigmoid(self.logits(hidden, scalars))


def save_predictor(model: SurvivalMLP, path: str | Path, signal: SurvivalSignal | str,
                   scalar_names: tuple[str, ...] | None = None) -> None:
    """Write ``{state_dict, in_features, hidden_size, num_scalars, normalization,
    feature_names, signal}`` with ``torch.save``."""
    names = list(scalar_names or [f"scalar_{i}" for i in range(model.num_scalars)])
    torch.save({
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "in_features": model.in_features,
        "hidden_size": model.hidden_size,
        "num_scalars": model.num_scalars,
        "normalization": {"mean": model.feature_mean.detach().cpu(),
                          "std": model.feature_std.detach().cpu()},
        "feature_names": [f"hidden_{i}" for i in range(model.hidden_size)] + names,
        "signal": SurvivalSignal(signal).value,
    }, path)


def load_predictor(path: str | Path, map_location: str | torch.device = "cpu") -> SurvivalMLP:
    """A saved predictor in eval mode; its forward applies the stored normalization."""
    saved = torch.load(path, map_location=map_location, weights_only=True)
    model = SurvivalMLP(saved["hidden_size"], saved["num_scalars"])
    model.load_state_dict(saved["state_dict"])
    return model.to(map_location).eval()


@torch.no_grad()
def block_scores(
    predictor: SurvivalMLP,
    # [batch, block, hidden] float
    hidden: torch.Tensor,
    # [batch, block, num_scalars] float
    scalars: torch.Tensor,
) -> torch.Tensor:  # [batch, block] float32: q_j for core.skip_policy.feasible_prefix
    """Per-position survival scores of whole draft blocks (dropout off during the call)."""
    batch, block, _ = hidden.shape
    device = predictor.feature_mean.device
    was_training = predictor.training
    predictor.eval()
    try:
        q = predictor(hidden.reshape(batch * block, -1).to(device),
                      scalars.reshape(batch * block, -1).to(device))  # [batch * block]
    finally:
        predictor.train(was_training)
    return q.view(batch, block).to(hidden.device)


@dataclass(frozen=True)
class _Tokens:
    """The labelled (round, position) pairs of one fold set."""

    block_idx: torch.Tensor  # [num_tokens] int64: row
    pos_idx: torch.Tensor  # [num_tokens] int64: column (position j - 1)
    labels: torch.Tensor  # [num_tokens] float32

    def __len__(self) -> int:
        return self.block_idx.numel()

    def take(self, index) -> _Tokens:  # index: a slice, [k] int64 or [num_tokens] bool
        return _Tokens(self.block_idx[index], self.pos_idx[index], self.labels[index])

    def chunks(self, size: int):  # consecutive _Tokens of at most `size` tokens
        return (self.take(slice(start, start + size)) for start in range(0, len(self), size))


def _features(traces: SurvivalTraces, tokens: _Tokens, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, hidden], [.., num_scalars]
    hidden = traces.hidden[tokens.block_idx, tokens.pos_idx]  # [num_tokens, hidden]
    scalars = traces.scalars[tokens.block_idx, tokens.pos_idx]  # [num_tokens, num_scalars]
    return hidden.to(device, torch.float32), scalars.to(device, torch.float32)


def _feature_stats(traces: SurvivalTraces, tokens: _Tokens
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # [in_features] each, float32
    """Mean and std (population; below ``STD_FLOOR`` -> 1) of ``concat(hidden, scalars)`` over
    ``tokens`` only: the caller passes the training folds' tokens."""
    total, total_sq = 0.0, 0.0
    for part in tokens.chunks(STATS_CHUNK):
        x = torch.cat(_features(traces, part, torch.device("cpu")), -1).double()  # [chunk, in]
        total, total_sq = total + x.sum(0), total_sq + (x * x).sum(0)
    mean = total / len(tokens)  # [in_features]
    std = (total_sq / len(tokens) - mean * mean).clamp(min=0).sqrt()  # [in_features]
    return mean.float(), torch.where(std < STD_FLOOR, 1.0, std).float()


@torch.no_grad()
def _predict_logits(model: SurvivalMLP, traces: SurvivalTraces, tokens: _Tokens,
                    batch_tokens: int, device: torch.device) -> torch.Tensor:  # [num_tokens]
    model.eval()
    return torch.cat([model.logits(*_features(traces, part, device)).cpu()
                      for part in tokens.chunks(batch_tokens)])


def _bce(logits: torch.Tensor, labels: torch.Tensor) -> float:  # [num_tokens] each
    return float(F.binary_cross_entropy_with_logits(logits.double(), labels.double()))


@dataclass
class _Fit:
    model: SurvivalMLP
    val_bce: float
    best_epoch: int


def _fit(traces: SurvivalTraces, train: _Tokens, val: _Tokens, *, epochs: int, batch_tokens: int,
         lr: float, seed: int, device: torch.device, desc: str, progress: bool) -> _Fit:
    """Adam on BCE with logits; keep the state after the epoch with the lowest validation BCE."""
    mean, std = _feature_stats(traces, train)  # [in_features] each: training folds only
    torch.manual_seed(seed)  # weight init and dropout (reseeds the global generator)
    model = SurvivalMLP(traces.hidden.shape[-1], traces.scalars.shape[-1])
    model.feature_mean.copy_(mean)
    model.feature_std.copy_(std)
    model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    shuffle = torch.Generator().manual_seed(seed)
    best = _Fit(model, math.inf, -1)
    best_state = {k: v.clone() for k, v in model.state_dict().items()}
    bar = tqdm(range(epochs), desc=desc, disable=not progress, mininterval=2.0)
    for epoch in bar:
        model.train()
        order = torch.randperm(len(train), generator=shuffle)  # [num_tokens]
        for start in range(0, len(order), batch_tokens):
            batch = train.take(order[start : start + batch_tokens])
            logits = model.logits(*_features(traces, batch, device))  # [batch_tokens]
            loss = F.binary_cross_entropy_with_logits(logits, batch.labels.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        val_bce = _bce(_predict_logits(model, traces, val, batch_tokens, device), val.labels)
        if val_bce < best.val_bce:
            best = _Fit(model, val_bce, epoch)
            best_state = {k: v.clone() for k, v in model.state_dict().items()}
        bar.set_postfix(val_bce=f"{val_bce:.4f}", best=f"{best.val_bce:.4f}")
    model.load_state_dict(best_state)
    model.eval()
    return best


def _position_baseline(train: _Tokens, block: int) -> torch.Tensor:  # [block] float64
    """Per-position mean training label (the overall mean where a position has no token)."""
    counts = torch.bincount(train.pos_idx, minlength=block).double()  # [block]
    positives = torch.bincount(train.pos_idx, weights=train.labels.double(), minlength=block)
    overall = float(train.labels.double().mean())
    rate = torch.where(counts > 0, positives / counts.clamp(min=1), overall)  # [block]
    return rate.clamp(PROB_FLOOR, 1 - PROB_FLOOR)


@dataclass
class RotationResult:
    """One rotation. BCEs are per-token means in nats; ``best_epoch`` counts from 0."""

    rotation: int
    train_folds: list[int]
    validation_fold: int
    test_fold: int
    num_train_tokens: int
    best_epoch: int
    validation_bce: float
    test_bce: float
    baseline_test_bce: float  # position-only baseline on the same test tokens


@dataclass
class SurvivalReport:
    """Cross-validated quality of one signal's predictor; ``predictor`` is the saved one."""

    signal: str
    rotations: list[RotationResult]
    mean_test_bce: float
    mean_baseline_test_bce: float
    auroc: float | None  # pooled out-of-fold predictions, all positions
    per_position_auroc: list[float | None]  # position j = index + 1; None: one class only
    final: dict  # the saved predictor: train folds, validation fold, best epoch, its BCE
    settings: dict
    predictor: SurvivalMLP | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        """Everything but the predictor, as JSON-ready values."""
        out = {k: v for k, v in self.__dict__.items() if k != "predictor"}
        return {**out, "rotations": [asdict(r) for r in self.rotations]}


def _auroc_or_none(scores: torch.Tensor, labels: torch.Tensor) -> float | None:  # [num_tokens] each
    both = 0 < float(labels.sum()) < labels.numel()
    return auc(scores, labels) if both else None


def _signal_tokens(traces: SurvivalTraces, signal: SurvivalSignal) -> _Tokens:
    labels, mask = survival_labels(traces.accepted, traces.num_draft_tokens, traces.block, signal)
    block_idx, pos_idx = mask.nonzero(as_tuple=True)  # [num_tokens] each
    return _Tokens(block_idx, pos_idx, labels[block_idx, pos_idx])


def _cross_validate(traces: SurvivalTraces, tokens: _Tokens, token_fold: torch.Tensor,
                    num_folds: int, seed: int, desc: str, fit_args: dict
                    ) -> tuple[list[RotationResult], torch.Tensor]:  # (per rotation, [num_tokens])
    """Every rotation's fit and test scores; returns the out-of-fold logits of every token."""
    out_of_fold = torch.zeros(len(tokens))  # [num_tokens] logits, each from its test rotation
    results = []
    for r in range(num_folds):
        rot = rotation(r, num_folds)
        train = tokens.take(torch.isin(token_fold, torch.tensor(rot.train)))
        val, test = tokens.take(token_fold == rot.validation), tokens.take(token_fold == r)
        if min(len(train), len(val), len(test)) == 0:
            raise ProveError(f"traces: rotation {r} has an empty train, validation or test fold")
        fit = _fit(traces, train, val, seed=seed + r, desc=f"{desc} rot {r}", **fit_args)
        logits = _predict_logits(fit.model, traces, test, fit_args["batch_tokens"],
                                 fit_args["device"])  # [num_test]
        out_of_fold[token_fold == r] = logits
        rate = _position_baseline(train, traces.block)[test.pos_idx]  # [num_test]
        results.append(RotationResult(
            rotation=r, train_folds=list(rot.train), validation_fold=rot.validation, test_fold=r,
            num_train_tokens=len(train), best_epoch=fit.best_epoch, validation_bce=fit.val_bce,
            test_bce=_bce(logits, test.labels),
            baseline_test_bce=float(F.binary_cross_entropy(rate, test.labels.double()))))
    return results, out_of_fold


def train_survival(traces: SurvivalTraces | str | Path, signal: SurvivalSignal | str,
                   out_dir: str | Path, epochs: int = EPOCHS, *, batch_tokens: int = BATCH_TOKENS,
                   lr: float = LR, num_folds: int = DEFAULT_NUM_FOLDS, fold_seed: int = FOLD_SEED,
                   seed: int = 0, device: str | torch.device | None = None,
                   progress: bool = True) -> SurvivalReport:
    """Five rotations (test r, validation r + 1 mod 5, train on the other three), then the
    final predictor refit on every fold but ``FINAL_VALIDATION_FOLD``, which early-stops it.

    Writes ``out_dir/{signal}.pt`` (``save_predictor``) and merges this signal's entry into
    ``out_dir/report.json``. Test BCE is per rotation and their mean, beside the position-only
    baseline (per position j, the training folds' mean label at j). AUROCs use the pooled
    out-of-fold predictions: each round is tested in exactly one rotation.
    """
    signal = SurvivalSignal(signal)
    if epochs < 1 or batch_tokens < 1:
        raise ProveError(f"epochs and batch_tokens must be >= 1, got {epochs} and {batch_tokens}")
    if not isinstance(traces, SurvivalTraces):
        traces = load_traces(traces)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    fit_args = dict(epochs=epochs, batch_tokens=batch_tokens, lr=lr, device=device,
                    progress=progress)
    tokens = _signal_tokens(traces, signal)
    token_fold = fold_assignment(traces.prompt_id, num_folds, fold_seed)[tokens.block_idx]
    results, out_of_fold = _cross_validate(traces, tokens, token_fold, num_folds, seed,
                                           signal.value, fit_args)
    final_folds = [f for f in range(num_folds) if f != FINAL_VALIDATION_FOLD]
    final = _fit(traces, tokens.take(token_fold != FINAL_VALIDATION_FOLD),
                 tokens.take(token_fold == FINAL_VALIDATION_FOLD), seed=seed + num_folds,
                 desc=f"{signal.value} final", **fit_args)
    at = [tokens.pos_idx == j for j in range(traces.block)]  # [num_tokens] bool per position
    report = SurvivalReport(
        signal=signal.value, rotations=results,
        mean_test_bce=sum(x.test_bce for x in results) / num_folds,
        mean_baseline_test_bce=sum(x.baseline_test_bce for x in results) / num_folds,
        auroc=_auroc_or_none(out_of_fold, tokens.labels),
        per_position_auroc=[_auroc_or_none(out_of_fold[m], tokens.labels[m]) for m in at],
        final={"train_folds": final_folds, "validation_fold": FINAL_VALIDATION_FOLD,
               "best_epoch": final.best_epoch, "validation_bce": final.val_bce},
        settings={"epochs": epochs, "batch_tokens": batch_tokens, "lr": lr, "num_folds": num_folds,
                  "fold_seed": fold_seed, "seed": seed, "num_blocks": traces.accepted.numel(),
                  "num_tokens": len(tokens), "positive_rate": float(tokens.labels.mean())},
        predictor=final.model.cpu())
    _write(report, traces.scalar_names, Path(out_dir))
    return report


def _write(report: SurvivalReport, scalar_names: tuple[str, ...] | None, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_predictor(report.predictor, out / f"{report.signal}.pt", report.signal, scalar_names)
    path = out / "report.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged[report.signal] = report.to_dict()  # one entry per signal: both can share out_dir
    path.write_text(json.dumps(merged, indent=2) + "\n")
