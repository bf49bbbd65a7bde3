"""Every setting of the project, as validated data (pydantic).

A bad value fails at once with pydantic's message, which names the field and the allowed
range (e.g. `theta: Input should be less than or equal to 1`). Named presets live in
`vllm_prove/configs/*.json` and load through `load_preset`.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vllm_prove.core.rules import GateKind
from vllm_prove.errors import ProveError

CONFIGS_DIR = Path(__file__).resolve().parent / "configs"  # package data; ./configs links here


class Method(str, enum.Enum):
    """Decoding methods (docs/METHODS.md §3-5)."""

    AR = "ar"  # greedy, one token per proposer pass
    SD = "sd"  # small drafter, k serial steps, proposer verifies greedily
    MARS = "mars"  # proposer-only tau rule, no verifier pass
    PROVE = "prove"  # proposer + small verifier + gate (lossy)
    PROVE_LOSSLESS = "prove-lossless"  # proposer verifies itself: greedy AR exactly
    SDD = "sdd"  # diffusion drafter, the target verifies greedily: greedy AR exactly (§7)
    SDD_LENIENCE = "sdd-lenience"  # accept while z_j(x_j) - max z_j >= log l (lossy)
    SDD_TOPK = "sdd-topk"  # accept while x_j is in the target's top-k (lossy)
    SDD_SKIP = "sdd-skip"  # strict SDD, but confident prefixes commit without the target (lossy)

    @property
    def diffusion(self) -> bool:
        """Drafts with the diffusion drafter (the SDD family)."""
        return self.value.startswith("sdd")


class SkipSignal(str, enum.Enum):
    """Per-position score q_j of verifier skipping and its prefix gate (docs/METHODS.md §7)."""

    RAW = "raw"  # the drafter's raw confidence; C_k = geometric mean
    MARGINAL = "marginal"  # marginal survival predictor a^_j; C_k = min
    CONDITIONAL = "conditional"  # conditional survival predictor s^_j; C_k = product


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)


class DecodeConfig(_Strict):
    """One decoding run."""

    method: Method = Method.PROVE_LOSSLESS
    """Which decoder to run."""
    block_size: int = Field(8, ge=2, le=64)
    """B: tokens proposed per cycle (the zoo's proposer was trained with B = 8)."""
    theta: float = Field(0.1, gt=0.0, le=1.0)
    """ProVe gate threshold (paper: 0.10 / 0.05 / 0.01)."""
    tau: float = Field(0.95, gt=0.0, le=1.0)
    """MARS confidence threshold (MARS paper: 0.95)."""
    gate: GateKind = GateKind.PRODUCT
    """Gate kind used by `method=prove`."""
    k: int = Field(3, ge=1, le=32)
    """SD draft length (paper baselines: 3 and 5)."""
    adaptive: bool = True
    """`--engine vllm`, methods prove-lossless and sd: the load-adaptive speculation depth
    (docs/METHODS.md §9); False = every request speculates the full depth every step."""
    max_tokens: int = Field(64, ge=1, le=1_000_000)
    """Generated tokens per request, at most (EOS stops earlier)."""
    batch_size: int = Field(1, ge=1, le=4096)
    """Requests in flight."""
    mask_token_id: int | None = Field(None, ge=0)
    """Placeholder id; None reads `mask_token_id` from the proposer's config.json."""
    proposer: str | None = None
    """Proposer checkpoint folder; None = the zoo's proposer."""
    verifier: str | None = None
    """Verifier / SD drafter checkpoint folder; None = the zoo's verifier."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Model dtype; exactness is judged in float32."""
    # -- speculative diffusion decoding (methods sdd*, docs/METHODS.md §7) ------------------
    drafter: str | None = None
    """Diffusion drafter checkpoint folder; None = the zoo's drafter."""
    gamma: int = Field(16, ge=2, le=256)
    """Draft block length (paper: 32; the zoo's drafter was trained with 8, 16 and 32)."""
    steps: int = Field(2, ge=1, le=256)
    """T: denoising passes per block (paper: 2); at most gamma."""
    lenience: float = Field(0.5, gt=0.0, le=1.0)
    """sdd-lenience: l; accept while the draft's target logit is within log l of the max (1 = strict)."""
    top_k: int = Field(2, ge=1)
    """sdd-topk: accept while the draft token is among the target's k largest logits."""
    signal: SkipSignal = SkipSignal.RAW
    """sdd-skip: the per-position score (raw confidence or a survival predictor)."""
    survival: str | None = None
    """sdd-skip with a survival signal: folder of `vllm-prove train survival` (marginal.pt, conditional.pt)."""
    k_min: int = Field(6, ge=0)
    """K_min: shortest prefix committed without the target (0: any K^ > 0; paper default 6)."""
    s_max: int = Field(64, ge=1)
    """S_max: unverified tokens allowed before a strict round is forced (paper default 64)."""
    eta_b: float = Field(0.90, ge=0.0, le=1.0)
    """Local gate threshold: B_k = min_{j<=k} q_j >= eta_b (paper, raw confidence: 0.90)."""
    eta_c: float = Field(0.93, ge=0.0, le=1.0)
    """Prefix gate threshold on C_k (paper, raw confidence: 0.93; conditional: 1 - epsilon)."""
    shadow: bool = True
    """sdd-skip: a shadow target pass audits every skipped round (StrictToken, FullPrefix) without
    touching decoding, the timing or the verifier-call count."""

    @model_validator(mode="after")
    def _steps_fit_gamma(self) -> "DecodeConfig":
        if self.steps > self.gamma:
            raise ProveError(f"steps ({self.steps}) must be <= gamma ({self.gamma}): each pass reveals a token")
        return self

    @model_validator(mode="after")
    def _survival_has_predictors(self) -> "DecodeConfig":
        if self.method is Method.SDD_SKIP and self.signal is not SkipSignal.RAW and self.survival is None:
            raise ProveError(f"signal {self.signal.value!r} needs survival: the folder written by "
                             "`vllm-prove train survival`")
        return self


class TrainConfig(_Strict):
    """One training stage (AR SFT or MARS block training)."""

    objective: Literal["ar", "mars", "diffusion"] = "mars"
    """`ar`: next-token CE. `mars`: clean + noisy copies, block mask (docs/METHODS.md §2).
    `diffusion`: block-diffusion drafter, masked-token CE (docs/METHODS.md §7, train/diffusion.py)."""
    block_size: int = Field(8, ge=2, le=64)
    """B of the MARS block mask (must equal the decoding block size); gamma for `diffusion`."""
    logits_shift: bool = False
    """`diffusion`: the output at p - 1 predicts p (Dream / DiffuCoder) instead of the output at
    p (MDLM / BERT); must match the drafter's setting at decoding."""
    min_mask_ratio: float = Field(0.05, gt=0.0, le=1.0)
    """`diffusion`: each block's mask ratio is drawn from U(min_mask_ratio, 1)."""
    ar_weight: float = Field(1.0, ge=0.0)
    """Weight of the clean-copy CE in the MARS loss."""
    block_size_mix: tuple[int, ...] = ()
    """MARS: if set, every step draws its block size from these (one model then serves every
    decoding B up to the largest: a smaller block is a prefix of a larger one's layout)."""
    soft_weight: float = Field(0.0, ge=0.0, le=1.0)
    """Self-distillation: share of the block loss that is KL to the teacher's next-token
    distribution (0 = hard greedy targets only; needs a teacher)."""
    anchor: Literal["self", "teacher"] | None = None
    """Self-distillation, clean-copy term: `self` = CE on the targets (the AR behaviour follows
    the data); `teacher` = KL to the frozen starting model at every position, and that model
    writes every round's targets (calibrated: the fine-tuned model keeps the teacher's greedy
    output and its likelihood of real text). None: `teacher` under self-distillation (the
    recommended recipe, the zoo's), `self` otherwise (`resolved_anchor`)."""
    lr: float = Field(1e-3, gt=0.0, le=1.0)
    """Peak AdamW learning rate (cosine decay to 10%)."""
    weight_decay: float = Field(0.1, ge=0.0)
    warmup_steps: int = Field(50, ge=0)
    steps: int = Field(1000, ge=1)
    """Optimizer steps of this stage."""
    batch_size: int = Field(16, ge=1)
    seq_len: int = Field(256, ge=4, le=32768)
    """Tokens per training window (the MARS input is twice this)."""
    grad_clip: float = Field(1.0, gt=0.0)
    seed: int = 0
    checkpoint_every: int = Field(200, ge=1)
    """Steps between checkpoints (model + optimizer + RNG); `--resume` continues from the last."""
    lora_rank: int = Field(0, ge=0, le=1024)
    """0: full fine-tuning. Otherwise a low-rank adapter (alpha = 2 x rank) on every linear layer,
    plus the mask token's embedding row: what is trained and shipped is a few MB."""

    def resolved_anchor(self, self_distill: bool) -> str:
        return self.anchor or ("teacher" if self_distill else "self")

    @model_validator(mode="after")
    def _block_mix_in_range(self) -> "TrainConfig":
        bad = [b for b in self.block_size_mix if not 2 <= b <= 64]
        if bad:
            raise ProveError(f"block_size_mix: every block size must be in [2, 64], got {bad}")
        return self

    @model_validator(mode="after")
    def _warmup_fits(self) -> "TrainConfig":
        if self.warmup_steps >= self.steps:
            raise ProveError(f"warmup_steps ({self.warmup_steps}) must be < steps ({self.steps})")
        return self


def load_preset(name: str) -> dict:
    """Read `configs/NAME.json` (a dict of sections: decode, skip, train)."""
    path = CONFIGS_DIR / f"{name}.json"
    if not path.exists():
        known = sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))
        raise ProveError(f"unknown preset {name!r}; known presets: {known}")
    return json.loads(path.read_text())


class EngineMode(str, enum.Enum):
    """ProVe modes inside vLLM's V1 engine (`additional_config["prove"]["mode"]`)."""

    LOSSLESS = "lossless"  # docs/METHODS.md §4: mask pass over the served model's own KV, vLLM verifies
    VERIFIER = "verifier"  # docs/METHODS.md §3: a small verifier scores the block, a gate commits
    MARS = "mars"  # docs/METHODS.md §5: the tau rule, no verifier pass
    SD = "sd"  # vLLM's own draft-model SD (the user's speculative_config), under the adaptive depth
    SDD = "sdd"  # docs/METHODS.md §7: a diffusion drafter drafts, the target verifies or is skipped

    @property
    def gated(self) -> bool:
        """Whether a ProVe gate (not vLLM's rejection sampler) decides what is committed."""
        return self in (EngineMode.VERIFIER, EngineMode.MARS)


_DECODE_FIELDS = DecodeConfig.model_fields  # shared field definitions: one place for each range


class ProveEngineConfig(_Strict):
    """`additional_config["prove"]` of a vLLM engine (`vllm_prove.engine`), validated at start-up.

    The served model is always the proposer. vLLM's `num_speculative_tokens` follows from the
    block size: `B` in lossless mode (the mask pass drafts y_1..y_B, vLLM verifies them),
    `B - 1` mask placeholders in the gated modes (the window pass proposes y_1..y_B).
    """

    mode: EngineMode = EngineMode.LOSSLESS
    """Which ProVe mode the engine runs."""
    block_size: int = _DECODE_FIELDS["block_size"]
    """B: tokens proposed per cycle (the zoo's proposer was trained with B = 8)."""
    theta: float = _DECODE_FIELDS["theta"]
    """Gate threshold of the verifier gates (`mode=verifier`)."""
    tau: float = _DECODE_FIELDS["tau"]
    """Threshold of the proposer-only gate (`mode=mars`, or `gate=proposer`)."""
    gate: GateKind = _DECODE_FIELDS["gate"]
    """Gate of `mode=verifier`; `mode=mars` always uses the proposer-only gate."""
    verifier: str | None = _DECODE_FIELDS["verifier"]
    """Verifier checkpoint folder (`mode=verifier`); None = speculative_config["model"]."""
    mask_token_id: int | None = _DECODE_FIELDS["mask_token_id"]
    """Placeholder id; None reads `mask_token_id` from the served model's config.json."""
    on_unsupported: Literal["fallback", "refuse"] = "fallback"
    """Gated modes, a request the gate cannot decode exactly (temperature > 0, logprobs, n > 1,
    penalties, ...): `fallback` decodes it in the same batch with vLLM's sampler and no window;
    `refuse` answers 400 naming the fields."""
    adaptive: bool | None = None
    """Load-adaptive speculation depth (docs/METHODS.md §9): every engine step, each request's
    depth from measured step costs and acceptance. None = on where built (lossless, sd), off in
    the gated modes (whose window depth is not adaptive yet); False = the fixed depth."""
    adaptive_policy: Literal["measured", "speculate", "random", "plain"] = "measured"
    """`measured`: per load, the guard decides whether to speculate from measured throughput and
    the solver how deep (docs/METHODS.md §9); `speculate`: the solver's depths every step, never
    plain decoding (a load that must speculate, whatever it measures); `random`: depths drawn at
    random every step (a diagnostic: exact modes must not change their output); `plain`: depth 0
    every step (a diagnostic: what the engine costs with speculation idle)."""
    # -- mode sdd (docs/METHODS.md §7): block_size is gamma, the drafted block (default: gamma's)
    drafter: str | None = _DECODE_FIELDS["drafter"]
    """Diffusion drafter folder (`mode=sdd`; `diffusion_drafter` in its config.json says its kind)."""
    steps: int = _DECODE_FIELDS["steps"]
    """T: denoising passes per drafted block (`mode=sdd`); at most block_size."""
    rule: Literal["strict", "lenience", "topk", "skip"] = "strict"
    """`mode=sdd`: `strict` (greedy AR exactly; exact speculative sampling at temperature > 0),
    `lenience` / `topk` (lossy acceptance of greedy requests), `skip` (strict verification that
    a policy may skip: a confident draft prefix is committed with no target pass for it)."""
    lenience: float = _DECODE_FIELDS["lenience"]
    top_k: int = _DECODE_FIELDS["top_k"]
    signal: SkipSignal = _DECODE_FIELDS["signal"]
    survival: str | None = _DECODE_FIELDS["survival"]
    k_min: int = _DECODE_FIELDS["k_min"]
    s_max: int = _DECODE_FIELDS["s_max"]
    eta_b: float = _DECODE_FIELDS["eta_b"]
    eta_c: float = _DECODE_FIELDS["eta_c"]

    @model_validator(mode="before")
    @classmethod
    def _sdd_block_is_gamma(cls, data):
        """Mode `sdd` drafts a block of gamma tokens: unset, it is `DecodeConfig.gamma`'s default
        (the CLI's), not the ProVe block size B."""
        if isinstance(data, dict) and data.get("mode") == EngineMode.SDD:  # (a str enum: "sdd" too)
            data = {"block_size": _DECODE_FIELDS["gamma"].default, **data}
        return data

    @model_validator(mode="after")
    def _verifier_only_in_verifier_mode(self) -> "ProveEngineConfig":
        if self.verifier is not None and self.mode is not EngineMode.VERIFIER:
            raise ProveError(f"verifier: only mode='verifier' reads a verifier, got mode={self.mode.value!r}")
        if self.adaptive and self.mode in (EngineMode.VERIFIER, EngineMode.MARS, EngineMode.SDD):
            raise ProveError(f"adaptive: mode={self.mode.value!r} speculates a fixed window (the adaptive depth "
                             "runs in modes 'lossless' and 'sd'); leave adaptive unset or false")
        if self.drafter is not None and self.mode is not EngineMode.SDD:
            raise ProveError(f"drafter: only mode='sdd' reads a diffusion drafter, got mode={self.mode.value!r}")
        if self.mode is EngineMode.SDD:
            if self.drafter is None:
                raise ProveError("drafter: mode='sdd' needs the diffusion drafter's folder")
            if self.steps > self.block_size:
                raise ProveError(f"steps ({self.steps}) must be <= block_size ({self.block_size}, gamma in "
                                 "mode 'sdd'): each denoising pass reveals a token")
            if self.rule == "skip" and self.signal is not SkipSignal.RAW and self.survival is None:
                raise ProveError(f"survival: signal {self.signal.value!r} needs the folder written by "
                                 "`vllm-prove train survival`")
        return self

    @property
    def adaptive_on(self) -> bool:
        """Whether the adaptive depth controller runs (the `adaptive` default resolved)."""
        if self.adaptive is None:
            return self.mode in (EngineMode.LOSSLESS, EngineMode.SD)
        return self.adaptive

    @property
    def num_speculative_tokens(self) -> int:
        """vLLM's `num_speculative_tokens` for this mode and block size."""
        return self.block_size - 1 if self.mode.gated else self.block_size

    @property
    def threshold(self) -> float:
        """The gated modes' threshold: tau for the proposer-only gate, theta otherwise."""
        return self.tau if self.gate_kind is GateKind.PROPOSER else self.theta

    @property
    def gate_kind(self) -> GateKind:
        """The gate a gated mode applies (MARS is the proposer-only gate, docs/METHODS.md §5)."""
        return GateKind.PROPOSER if self.mode is EngineMode.MARS else self.gate
