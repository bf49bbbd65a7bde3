"""Drafters that share the served model's weights and KV cache (no second copy of either).

``SelfMaskProposer`` is ProVe-lossless' proposer (docs/METHODS.md §1, §4) on vLLM's
``draft_model`` + ``parallel_drafting`` pipeline: the scheduler reserves
``num_speculative_tokens`` look-ahead KV slots (``vllm/config/vllm.py:636``), the runner
hands the drafter's probabilities to the rejection sampler
(``vllm/v1/worker/gpu_model_runner.py:5019``), and vLLM's standard verification makes the
output identical to plain greedy decoding (exact speculative sampling when temperature > 0).
Only two things change: ``load_model`` shares the target instead of loading a copy, and the
first (only) drafter pass reads ``[s, mask x (K-1)]`` per request instead of re-feeding the
target's tokens::

    KV positions:   ... c-1 | p   | p+1  ...  p+K-1          (p: first uncommitted position)
    drafter input:          | s   | mask ...  mask            (s: the token just sampled)
    drafter output:         | d_1 | d_2  ...  d_K            (d_1 is the greedy AR token)

The mask slots ``p+1..p+K-1`` lie inside the look-ahead the scheduler reserved, and the next
verification pass (positions ``p..p+K``) overwrites every one of them with real tokens
before any attention reads them (``docs/design/vllm_engine.md`` A.2), so the cache only ever
serves real tokens to verification.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
from vllm.config import get_layers_from_vllm_config
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.spec_decode.utils import PADDING_SLOT_ID

logger = init_logger(__name__)
SAMPLING_EPS = 1e-5  # vLLM's greedy threshold on the temperature (vllm/v1/sample/sampler.py)


class SharedTargetProposer(DraftModelProposer):
    """A ``DraftModelProposer`` whose draft model *is* the served model.

    vLLM's own ``_get_model`` (``vllm/v1/spec_decode/draft_model.py:103``) would build a
    second copy under the prefix ``draft_model``, whose attention layers would get a second
    KV cache. Here ``self.model`` is the target ``nn.Module`` and the "draft layers" are the
    target's own attention layers (``llm_base_proposer.py:1319`` keeps only layers *not* in
    the target; we keep all), so ``initialize_attn_backend`` builds metadata for the
    target's KV tensors and nothing new is allocated.
    """

    def load_model(self, target_model: nn.Module) -> None:
        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)  # type: ignore[type-abstract]
        self._draft_attn_layer_names = {
            name for name, layer in layers.items() if layer.get_kv_cache_spec(self.vllm_config) is not None
        }
        self.model = target_model
        self.supports_mm_inputs = False
        logger.info("ProVe: drafter shares the served model and its KV layers %s", sorted(self._draft_attn_layer_names))


class SelfMaskProposer(SharedTargetProposer):
    """ProVe-lossless' mask pass: drafts ``d_1..d_K`` from ``[s, mask x (K-1)]`` in one pass."""

    def __init__(self, vllm_config, device: torch.device, runner=None):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        if not self.parallel_drafting:
            raise ValueError("SelfMaskProposer needs speculative_config['parallel_drafting'] = True")
        # vLLM read mask_token_id from the (served) draft model's config.json (l.356-385).
        self.mask_token_id = self.parallel_drafting_token_id
        self._runner = runner
        self._draft_offsets = torch.arange(self.num_speculative_tokens, dtype=torch.int64, device=device)  # [K]

    def propose(self, num_speculative_tokens, *args, **kwargs) -> torch.Tensor:
        """vLLM's ``propose``; at depth 0 (the adaptive depth's plain step) no mask pass at all:
        the target's own KV is already complete, nothing needs to be kept in step."""
        if num_speculative_tokens == 0:
            self.num_speculative_tokens, self._last_draft_probs = 0, None
            batch = kwargs["common_attn_metadata"].batch_size()
            return torch.empty(batch, 0, dtype=torch.int64, device=self.device)
        return super().propose(num_speculative_tokens, *args, **kwargs)

    def set_inputs_first_pass(
        self,
        target_token_ids: torch.Tensor,
        # [batch] the token sampled this step (s), one per request
        next_token_ids: torch.Tensor,
        target_positions: torch.Tensor,
        target_hidden_states: torch.Tensor,
        token_indices_to_sample: torch.Tensor | None,
        cad: CommonAttentionMetadata,
        # [batch] or None: drafts the verification just rejected, per request
        num_rejected_tokens_gpu: torch.Tensor | None,
    ) -> tuple[int, torch.Tensor, CommonAttentionMetadata]:
        """Lay out ``[s, mask x (K-1)]`` at positions ``p..p+K-1`` of each request.

        Replaces ``SpecDecodeBaseProposer.set_inputs_first_pass`` (``llm_base_proposer.py:817``),
        which would re-feed every target token of the step: they are already in the cache.
        Returns (number of drafter tokens, indices of the rows to sample, drafter metadata);
        every row is sampled, so ``propose`` returns ``[batch, K]`` drafts (l.629-636).
        """
        num_spec, batch = self.num_speculative_tokens, cad.batch_size()
        num_tokens = batch * num_spec
        start = cad.seq_lens.to(torch.int64)  # [batch]: seq_len after the target pass
        if num_rejected_tokens_gpu is not None:
            start = start - num_rejected_tokens_gpu.to(torch.int64)  # first uncommitted position
        positions = (start[:, None] + self._draft_offsets[None, :num_spec]).view(-1)  # [batch * K]
        input_ids = torch.full((batch, num_spec), self.mask_token_id, dtype=torch.int32, device=self.device)
        input_ids[:, 0] = next_token_ids.to(torch.int32)
        self.input_ids[:num_tokens] = input_ids.view(-1)
        # Positions past max_model_len occur only for rows that will never verify these drafts
        # (vLLM caps their spec tokens); clamp them for RoPE and write their KV nowhere.
        clamped = positions.clamp(max=self.max_model_len - 1)  # [batch * K]
        self.positions[:num_tokens] = clamped
        slot_mapping = self._slot_mapping(cad, clamped, num_spec)  # [batch * K]
        slot_mapping = slot_mapping.masked_fill(positions >= self.max_model_len, PADDING_SLOT_ID)
        query_start_loc_cpu = torch.arange(batch + 1, dtype=torch.int32) * num_spec  # host: no device sync
        upper_bound = cad.seq_lens_cpu_upper_bound
        drafter_cad = cad.replace(
            query_start_loc=query_start_loc_cpu.to(self.device, non_blocking=True),
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens=(start + num_spec).clamp(max=self.max_model_len).to(cad.seq_lens.dtype),
            seq_lens_cpu_upper_bound=None if upper_bound is None else upper_bound + num_spec,
            num_actual_tokens=num_tokens,
            max_query_len=num_spec,
            max_seq_len=min(cad.max_seq_len + num_spec, self.max_model_len),
            slot_mapping=slot_mapping,
            causal=True,
            positions=None,
            is_prefilling=None,
        )
        sample_indices = torch.arange(num_tokens, dtype=torch.int32, device=self.device)  # [batch * K]
        return num_tokens, sample_indices, drafter_cad

    def _sample_draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata):
        """vLLM's draft sampling, but a seeded request's drafts come from its own generator.

        vLLM draws draft noise from the global RNG ("TODO: Consider seeds",
        ``llm_base_proposer.py:1850``): exact in distribution, but a seeded request then samples
        other text in another batch. Here the rows of every seeded, sampled request are redrawn
        with its generator (``K`` exponential rows per step, whatever the batch), so the same seed
        gives the same text alone and among any requests. Rows of requests whose sample this step
        is discarded (a prompt still being prefilled) keep the global draw: their drafts are
        never verified and their generator must not move.
        """
        draft_token_ids, draft_probs = super()._sample_draft_tokens(hidden_states, sampling_metadata)
        generators = sampling_metadata.generators
        if draft_probs is None or not generators:
            return draft_token_ids, draft_probs
        k = self.num_speculative_tokens
        discarded = self._runner.discard_request_mask.np if self._runner is not None else None
        temperature = sampling_metadata.temperature  # [batch] or [batch * K]
        for req_index, gen in generators.items():
            if discarded is not None and discarded[req_index]:
                continue
            rows = slice(req_index * k, (req_index + 1) * k)
            t = temperature[req_index * k if temperature.numel() == draft_probs.shape[0] else req_index]
            if float(t) < SAMPLING_EPS:
                continue  # greedy: super() took the argmax
            probs = draft_probs[rows]  # [K, vocab] float32
            noise = torch.empty_like(probs).exponential_(generator=gen)  # [K, vocab]
            draft_token_ids[rows] = probs.div(noise).argmax(dim=-1).to(draft_token_ids.dtype)
        return draft_token_ids, draft_probs

    def _slot_mapping(
        self,
        cad: CommonAttentionMetadata,
        # [batch * K] int64, each < max_model_len
        positions: torch.Tensor,
        num_spec: int,
    ) -> torch.Tensor:  # [batch * K] int64: KV slot of each drafter token
        return kv_slots(cad.block_table_tensor, positions, np.full(cad.batch_size(), num_spec), self.block_size)


class CatchUpDraftModelProposer(DraftModelProposer):
    """vLLM's draft model (mode ``sd``) for the adaptive depth: a plain step runs no draft pass at all.

    vLLM's draft model keeps its own KV by re-reading, in every step's first pass, the tokens the
    target just read (``llm_base_proposer.py:817``), so vLLM runs that pass even when it drafts
    nothing (dynamic depth 0, l.614-623). That pass cost a plain step of the adaptive ``sd`` engine
    a third of an AR step on the CPU (plain decoding read 48-68 tokens per request-second against
    AR's 87 at 16 in flight, docs/BENCHMARKS.md), so plain decoding could never win there.

    Here a step that drafts nothing skips the drafter; per request, ``lag`` keeps the first
    position whose draft KV a skipped step left unwritten. The next step that drafts first runs
    *catch-up* passes of the draft model over each lagging request's committed tokens
    ``[lag, c)`` (``c``: the step's first target position; prefill-like, causal over the KV
    before, eager), then vLLM's own pass reads ``[c, ...)`` as always, so every draft is
    computed from the draft KV vLLM's own schedule would have left. A request admitted with a
    prefix-cache hit reads cached blocks whose draft KV a plain step may have left unwritten: it
    catches up from the first such block (``stale``: the blocks of requests that left lagging,
    and those past the lag of requests that still lag), and reuses the draft KV of the blocks
    before it, as vLLM's draft model does (a bench that repeats its prompts admits every request
    on a hit: catching each one up from position 0 cost adaptive SD 33 ms a step against vLLM's
    29 at 16 in flight, docs/BENCHMARKS.md). Drafts never decide a token (vLLM's
    rejection sampler does), so this is about acceptance, not exactness;
    ``tests/engine/test_engine_lossless.py`` checks that the drafts made after a catch-up are the
    draft model's own greedy continuation of the committed text.
    """

    def __init__(self, vllm_config, device: torch.device, runner=None):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        if self.uses_mrope or self.supports_mm_inputs:
            raise ValueError("the adaptive depth's draft-model catch-up reads token ids only (no M-RoPE, "
                             "no multimodal draft model); set \"adaptive\": false")
        self._runner = runner
        self.lag: dict[str, int] = {}  # request -> first position without draft KV
        # KV blocks whose draft KV may lack some position: written by plain steps of requests that
        # then left (finished, or resumed onto new blocks) without catching up
        self.stale: set[int] = set()
        self._catch_up: list[tuple[str, int, int]] = []  # (request, start, end) before this step's pass
        self.last_caught_up: frozenset[str] = frozenset()  # requests caught up before the last pass
        # requests admitted on prefix-cached blocks whose draft KV is reused (no catch-up) in the last pass
        self.last_reused: frozenset[str] = frozenset()
        self._reused: frozenset[str] = frozenset()

    def note_step(self, scheduler_output) -> None:
        """Every step with scheduled tokens or finished requests, before it runs (the runner still
        holds the finished ones): where each request's target pass starts, and whether the
        drafter will run after it (``num_spec_tokens_to_schedule``)."""
        for req_id in scheduler_output.finished_req_ids:
            self._leave(req_id)  # (the last requests of a run are reported in a step of their own)
        if not scheduler_output.total_num_scheduled_tokens:
            return
        cached = scheduler_output.scheduled_cached_reqs
        new_reqs = scheduler_output.scheduled_new_reqs
        starts = dict(zip(cached.req_ids, cached.num_computed_tokens))
        starts.update((new.req_id, new.num_computed_tokens) for new in new_reqs)
        # admitted on (or resumed onto) cached blocks: reuse their draft KV up to the first stale one
        admitted = [new.req_id for new in new_reqs] + list(cached.resumed_req_ids)
        for req_id in cached.resumed_req_ids:
            self._leave(req_id)  # (its old blocks, as the runner still has them)
        hits = [r for r in admitted if starts[r] > 0]
        reused = set()
        if hits:
            holders = self._stale_holders()
            for req_id in hits:
                first = self._first_stale_position(self._blocks(req_id, scheduler_output), starts[req_id], holders)
                if first is None:
                    reused.add(req_id)
                else:
                    self.lag[req_id] = first
        if scheduler_output.num_spec_tokens_to_schedule == 0:
            for req_id, start in starts.items():
                self.lag[req_id] = min(self.lag.get(req_id, start), start)
            self._catch_up, self._reused = [], frozenset()
            return
        self._catch_up = [(r, self.lag[r], c) for r, c in starts.items() if r in self.lag and self.lag[r] < c]
        self._reused = frozenset(reused)
        # after this step every request in it has draft KV up to its last token: the blocks it
        # caught up, and the blocks written afresh this step (newly admitted or allocated) are valid
        if self.stale:
            for req_id, _, _ in self._catch_up:
                self.stale.difference_update(*self._blocks(req_id, scheduler_output))
            for new in new_reqs:
                self.stale.difference_update(*new.block_ids)
            for new_ids in cached.new_block_ids:
                if new_ids is not None:
                    self.stale.difference_update(*new_ids)
        for req_id in starts:
            self.lag.pop(req_id, None)

    def _blocks(self, req_id: str, scheduler_output) -> tuple[list[int], ...]:
        """``req_id``'s KV block ids per group as of this step (the runner's own record is updated
        after ``note_step``)."""
        cached = scheduler_output.scheduled_cached_reqs
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id == req_id:
                return new.block_ids
        new_ids = cached.new_block_ids[cached.req_ids.index(req_id)]
        if req_id in cached.resumed_req_ids:
            return new_ids
        old = self._runner.requests[req_id].block_ids
        return old if new_ids is None else tuple(o + n for o, n in zip(old, new_ids))

    def _block_sizes(self) -> list[int]:
        return [group.kv_cache_spec.block_size for group in self._runner.kv_cache_config.kv_cache_groups]

    def _blocks_past_lag(self, req_id: str, lag: int) -> list[int]:
        """The runner's blocks of ``req_id`` that hold positions from ``lag`` on (none if it has
        no record of the request)."""
        state = self._runner.requests.get(req_id)
        if state is None:
            return []
        return [block for size, ids in zip(self._block_sizes(), state.block_ids) for block in ids[lag // size:]]

    def _leave(self, req_id: str) -> None:
        """A request leaves its blocks (finished, or resumed onto new ones): those past its lag
        keep a hole in their draft KV."""
        lag = self.lag.pop(req_id, None)
        if lag is not None:
            self.stale.update(self._blocks_past_lag(req_id, lag))

    def _stale_holders(self) -> set[int]:
        """``stale`` and the blocks past the lag of requests that still lag (live, or preempted)."""
        out = set(self.stale)
        for req_id, lag in self.lag.items():
            out.update(self._blocks_past_lag(req_id, lag))
        return out

    def _first_stale_position(self, block_ids: tuple[list[int], ...], start: int, stale: set[int]) -> int | None:
        """The first position before ``start`` in a block of ``stale`` (None: all draft KV there)."""
        first = None
        for size, ids in zip(self._block_sizes(), block_ids):
            for index, block in enumerate(ids[: -(-start // size)]):
                if block in stale:
                    first = index * size if first is None else min(first, index * size)
                    break
        return first

    def propose(self, num_speculative_tokens, *args, **kwargs) -> torch.Tensor:
        self.last_caught_up = frozenset(req_id for req_id, _, _ in self._catch_up)
        self.last_reused, self._reused = self._reused, frozenset()
        if self._catch_up:
            self._run_catch_up(kwargs["common_attn_metadata"])
        return super().propose(num_speculative_tokens, *args, **kwargs)

    def _run_catch_up(self, cad: CommonAttentionMetadata) -> None:
        """Draft-model passes over ``[start, end)`` of each lagging request, at most the drafter's
        token buffer per pass (a longer range continues in the next pass, over its own KV)."""
        batch = self._runner.input_batch
        token_ids = batch.token_ids_cpu  # [max_num_reqs, max_model_len] (numpy)
        budget = self.input_ids.shape[0]
        todo = [(batch.req_id_to_index[r], s, e) for r, s, e in self._catch_up if r in batch.req_id_to_index]
        self._catch_up = []
        while todo:
            rows, starts, ends, room = [], [], [], budget
            while todo and room:
                row, start, end = todo.pop(0)
                take = min(end - start, room)
                rows.append(row), starts.append(start), ends.append(start + take)
                room -= take
                if start + take < end:
                    todo.insert(0, (row, start + take, end))
            self._catch_up_pass(cad, token_ids, rows, starts, ends)

    def _catch_up_pass(self, cad, token_ids, rows: list[int], starts: list[int], ends: list[int]) -> None:
        lens = np.array(ends) - np.array(starts)  # [n]
        num_tokens = int(lens.sum())
        ids = torch.from_numpy(np.concatenate([token_ids[r, s:e] for r, s, e in zip(rows, starts, ends)]))
        positions = torch.from_numpy(np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)]))
        ids, positions = ids.to(self.device, torch.int32), positions.to(self.device, torch.int64)  # [num_tokens]
        if self.use_heterogeneous_vocab:
            ids = self.vocab_mapping.map_target_to_draft_ids(ids)
        self.input_ids[:num_tokens] = ids
        self._set_positions(num_tokens, positions)
        query_start_loc_cpu = torch.from_numpy(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))  # [n + 1]
        seq_lens_cpu = torch.tensor(ends, dtype=torch.int32)  # [n]
        block_table = cad.block_table_tensor[torch.tensor(rows, device=cad.block_table_tensor.device)]
        slot_mapping = kv_slots(block_table, positions, lens, self.block_size)  # [num_tokens]
        catch_cad = CommonAttentionMetadata(
            query_start_loc=query_start_loc_cpu.to(self.device, non_blocking=True),
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens=seq_lens_cpu.to(self.device, non_blocking=True),
            num_reqs=len(rows),
            num_actual_tokens=num_tokens,
            max_query_len=int(lens.max()),
            max_seq_len=max(ends),
            block_table_tensor=block_table,
            slot_mapping=slot_mapping,
            causal=True,
            seq_lens_cpu_upper_bound=seq_lens_cpu,
        )
        _, per_layer_attn_metadata = self.build_per_group_and_layer_attn_metadata(catch_cad)
        mode, num_input_tokens, across_dp = self._determine_batch_execution_and_padding(num_tokens,
                                                                                         use_cudagraphs=False)
        model_kwargs, slot_mapping_size = self.build_model_inputs_first_pass(num_tokens, num_input_tokens, None)
        with set_forward_context(per_layer_attn_metadata, self.vllm_config, num_tokens=num_input_tokens,
                                 num_tokens_across_dp=across_dp, cudagraph_runtime_mode=mode,
                                 slot_mapping=self._get_slot_mapping(slot_mapping_size, slot_mapping)):
            self.model(**model_kwargs)


def kv_slots(
    block_table: torch.Tensor,  # [n, max_blocks_per_req]: the block table rows of n requests
    positions: torch.Tensor,  # [sum(lens)] int64: positions, request after request
    lens: np.ndarray,  # [n]: tokens per request
    block_size: int,
) -> torch.Tensor:  # [sum(lens)] int64: the KV slot of each position
    rows = torch.repeat_interleave(torch.arange(len(lens), device=block_table.device),  # no device sync
                                   torch.as_tensor(lens, device=block_table.device), output_size=positions.shape[0])
    block_index = (positions // block_size).clamp(max=block_table.shape[1] - 1)
    return block_table[rows, block_index].to(torch.int64) * block_size + positions % block_size
