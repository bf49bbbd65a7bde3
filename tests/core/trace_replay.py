"""A noisy trace-replay simulator of an engine under the adaptive depth, engine-free.

The world is built from step traces recorded from real vLLM engines on a 2-core CPU
(``tests/core/traces/*.json``, written by ``scripts/record_step_traces.py``): per engine mode
and load, the step cost as a linear function of the step's shape (fitted to the trace of a
random depth schedule, which covers every shape), the trace's own residuals (each step's time
over the fit, replayed in order), and the acceptance of each draft position. On top of the
replayed residuals come the things a controller must not be fooled by:

- multiplicative noise per step (lognormal) and a slow drift of the machine's speed (AR(1)),
  together at least as large as the engine bench's A/A row (one AR engine against an identical
  one: 0.86-1.17x run to run);
- warm-up: the first steps of each new step shape, and the first steps of the run, run slow;
- bursts: stretches where every step is slower (another process on the machine);
- load changes: a scenario is a list of phases of a load each.

Requests run to ``max_tokens`` and are replaced as they finish; a new request's prompt rides in
the next step as prefill rows. The engine observes a step only once the next one is decided, as
``vllm_prove/engine/adaptive.py`` does. Throughput = committed tokens / simulated seconds.
"""

from __future__ import annotations


import json
import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from vllm_prove.core.adaptive import DraftKind, StepCost, StepShape

TRACES = Path(__file__).parent / "traces"
COLUMNS = ("load", "requests", "rows", "spec_requests", "draft_depth", "draft_passes", "draft_rows",
           "draft_requests", "prefill_rows", "seconds", "committed")
KINDS = {"lossless": DraftKind.PARALLEL, "sd": DraftKind.SEQUENTIAL}
DEPTHS = {"lossless": 8, "sd": 5}


@dataclass
class World:
    """One engine mode at one load, as recorded: cost fit, residuals, acceptance."""

    mode: str
    load: int
    cost: StepCost
    residuals: np.ndarray  # [steps] float: recorded seconds / fitted seconds, in trace order
    acceptance: np.ndarray  # [max_depth] float: a_i, draft i accepted once 1..i-1 were

    @property
    def kind(self) -> DraftKind:
        return KINDS[self.mode]

    @property
    def max_depth(self) -> int:
        return DEPTHS[self.mode]


def load_worlds(mode: str) -> dict[int, World]:
    """Per load, the world of ``mode`` from its random-schedule trace."""
    trace = json.loads((TRACES / f"{mode}-random.json").read_text())
    cols = trace["columns"]
    worlds = {}
    for load, entry in trace["loads"].items():
        rows = np.array(entry["steps"], dtype=np.float64)
        col = {name: rows[:, cols.index(name)] for name in cols}
        decoding = col["committed"] >= 0
        shapes = [StepShape(int(r), int(w), int(s), int(p), int(dr), int(dq), int(d), int(f))
                  for r, w, s, p, dr, dq, d, f in zip(col["requests"], col["rows"], col["spec_requests"],
                                                      col["draft_passes"], col["draft_rows"], col["draft_requests"],
                                                      col["draft_depth"], col["prefill_rows"])]
        x = np.stack([s.features() for s in shapes])
        coef = _nonnegative_lstsq(x, col["seconds"])
        cost = StepCost(*coef.tolist())
        fitted = np.maximum(x @ coef, 1e-6)
        residuals = (col["seconds"] / fitted)[decoding]
        verified = np.array(entry["verified_per_position"], dtype=np.float64)
        accepted = np.array(entry["accepted_per_position"], dtype=np.float64)
        acceptance = np.where(verified > 0, accepted / np.maximum(verified, 1), 0.0)
        worlds[int(load)] = World(mode, int(load), cost, residuals, acceptance[: DEPTHS[mode]])
    return worlds


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    active = list(range(x.shape[1]))
    while True:
        coef = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        negative = [a for a, c in zip(active, coef) if c < 0]
        if not negative:
            out = np.zeros(x.shape[1])
            out[active] = coef
            return out
        active = [a for a in active if a not in negative]


@dataclass
class Noise:
    """What the replay adds to the recorded residuals."""

    step_sigma: float = 0.05  # lognormal per step, beside the recorded residuals
    drift_sigma: float = 0.08  # stationary sd of the machine's log speed (AR(1)) ...
    drift_memory: float = 200.0  # ... and its correlation length in steps
    warmup_steps: int = 3  # the first steps of each new shape at a load ...
    warmup_factor: float = 1.6  # ... run this much slower
    start_steps: int = 60  # the run's first steps ...
    start_factor: float = 1.25  # ... run this much slower (caches, allocator, lazy init)
    burst_rate: float = 0.004  # chance per step that a burst starts ...
    burst_steps: int = 40  # ... lasting this long ...
    burst_factor: float = 1.35  # ... with every step this much slower
    prompt_rows: int = 40  # a new request's prompt, prefilled in one chunk


@dataclass
class Request:
    rid: int
    remaining: int
    drafts: int = 0  # drafts it holds for the next step


@dataclass
class Replay:
    """Replays ``worlds`` through a policy: ``policy(step_view) -> (depths by request, D)``."""

    worlds: dict[int, World]
    seed: int
    noise: Noise = field(default_factory=Noise)
    max_tokens: int = 48

    def run(self, phases: list[tuple[int, int]], controller=None, fixed_depth: int | None = None) -> float:
        """Committed tokens per second over ``phases`` ([(load, steps)]), driven by a
        ``DepthController`` (``controller``) or by a fixed depth (0: plain decoding)."""
        rng = random.Random(self.seed)  # acceptance draws
        machine = self.machine(sum(steps for _, steps in phases))  # the same for every policy (paired)
        requests: list[Request] = []
        next_id, prefill = 0, 0
        seen_shapes: dict = {}
        total_tokens, total_seconds = 0, 0.0
        pending = None  # the last step, observed after the next decision
        step_index = 0
        for load, steps in phases:
            world = self.worlds[min(self.worlds, key=lambda n: abs(n - load))]
            for _ in range(steps):
                while len(requests) < load:  # replace finished requests: their prompts ride in this step
                    requests.append(Request(next_id, self.max_tokens))
                    if controller is not None:
                        controller.expect(self.max_tokens)
                    next_id, prefill = next_id + 1, prefill + self.noise.prompt_rows
                del requests[load:]  # (a load that drops: requests leave)
                ids = [r.rid for r in requests]
                if controller is not None:
                    decision = controller.decide(ids, load=load)
                    depths, draft_depth = decision.depths, decision.draft_depth
                    if pending is not None:
                        controller.observe_step(*pending)
                else:
                    depths, draft_depth = dict.fromkeys(ids, fixed_depth), fixed_depth
                verify = {r.rid: min(depths.get(r.rid, 0), r.drafts) for r in requests}
                committed, verifications = 0, []
                for r in requests:
                    k = verify[r.rid]
                    accepted = 0
                    while accepted < k and rng.random() < world.acceptance[accepted]:
                        accepted += 1
                    n = min(1 + accepted, r.remaining)
                    r.remaining -= n
                    committed += n
                    if k:
                        verifications.append((r.rid, k, accepted))
                    r.drafts = draft_depth
                shape = StepShape.of(len(requests), sum(verify.values()), draft_depth, world.kind,
                                     extra_rows=prefill, spec_requests=sum(1 for k in verify.values() if k))
                shape = replace(shape, admitted=prefill // self.noise.prompt_rows)
                seconds = world.cost(shape) * machine[step_index] * self._warmup(world, shape, seen_shapes, step_index)
                total_tokens += committed
                total_seconds += seconds
                step_index += 1
                prefill = 0
                if controller is not None:
                    if verifications:
                        rid, k, a = zip(*verifications)
                        controller.observe_verifications(list(rid), list(k), list(a))
                    pending = (shape, seconds, committed, decision.load, controller.steps - 1)
                for r in [r for r in requests if r.remaining == 0]:
                    if controller is not None:
                        controller.finish(r.rid, self.max_tokens)
                    requests.remove(r)
        return total_tokens / total_seconds

    def machine(self, steps: int) -> np.ndarray:
        """[steps] float: each step's time factor, drawn from the seed alone so that every policy
        meets the same machine step by step (paired comparisons): a recorded residual (replayed
        in order from a random start), lognormal noise, the drift and the bursts."""
        noise, rng = self.noise, np.random.default_rng(self.seed)
        residuals = next(iter(self.worlds.values())).residuals
        start = int(rng.integers(len(residuals)))
        factor = residuals[(start + np.arange(steps)) % len(residuals)]
        factor = factor * np.exp(noise.step_sigma * rng.standard_normal(steps))
        rho = math.exp(-1.0 / noise.drift_memory)
        drift = np.empty(steps)
        level = noise.drift_sigma * rng.standard_normal()
        for i, z in enumerate(rng.standard_normal(steps)):
            drift[i] = level = rho * level + math.sqrt(1 - rho ** 2) * noise.drift_sigma * z
        factor *= np.exp(drift)
        burst = np.ones(steps)
        for start_at in np.flatnonzero(rng.random(steps) < noise.burst_rate):
            burst[start_at: start_at + noise.burst_steps] = noise.burst_factor
        factor *= burst
        factor[: noise.start_steps] *= noise.start_factor
        return factor

    def _warmup(self, world: World, shape: StepShape, seen: dict, step_index: int) -> float:
        """The first passes of a new step shape at a load run slow (a CPU's caches, a GPU's kernels)."""
        key = (world.load, shape.draft_depth, shape.spec_requests > 0)
        seen[key] = seen.get(key, 0) + 1
        return self.noise.warmup_factor if seen[key] <= self.noise.warmup_steps else 1.0


SEEDS = (0, 1, 2)
LOADS = (1, 2, 4, 8, 16, 32)
STEPS = 3000
# load changes, a burst-prone machine: one request, a wave at 16, back to one, then 32
MIXED = [(1, 600), (16, 600), (1, 600), (32, 600), (4, 600)]


def compare(mode: str, phases: list[tuple[int, int]], seed: int, controller_cls) -> dict:
    """The controller's throughput beside every fixed arm's (plain decoding and each fixed depth),
    on the same replayed machine."""
    worlds = load_worlds(mode)
    replay = Replay(worlds, seed)
    fixed = {depth: replay.run(phases, fixed_depth=depth) for depth in range(DEPTHS[mode] + 1)}
    controller = controller_cls(DEPTHS[mode], KINDS[mode])
    adaptive = replay.run(phases, controller=controller)
    best = max(fixed, key=fixed.get)
    return {"adaptive": adaptive, "plain": fixed[0], "best": fixed[best], "best_depth": best,
            "vs_best": adaptive / fixed[best], "vs_plain": adaptive / fixed[0]}


def main() -> None:
    """``python tests/core/trace_replay.py [--controller-from FILE] [--out JSON]``: the grid of
    the replay test as a table (``--controller-from``: a module file with a ``DepthController``,
    e.g. ``git show REV:vllm_prove/core/adaptive.py > old.py``, to compare another version)."""
    import argparse
    import importlib.util
    import sys

    from vllm_prove.core.adaptive import DepthController

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--controller-from", help="a module file defining DepthController")
    parser.add_argument("--out", help="write the rows as JSON")
    args = parser.parse_args()
    cls = DepthController
    if args.controller_from:
        spec = importlib.util.spec_from_file_location("other_adaptive", args.controller_from)
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        cls = module.DepthController
    rows = []
    for mode in KINDS:
        for name, phases in [(str(load), [(load, STEPS)]) for load in LOADS] + [("mixed", MIXED)]:
            for seed in SEEDS:
                row = {"mode": mode, "load": name, "seed": seed, **compare(mode, phases, seed, cls)}
                rows.append(row)
                print(f"{mode:9s} {name:>6s} seed {seed}: adaptive/best {row['vs_best']:.3f} (best D={row['best_depth']})"
                      f"  adaptive/plain {row['vs_plain']:.3f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
