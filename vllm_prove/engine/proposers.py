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

import torch
import torch.nn as nn
from vllm.config import get_layers_from_vllm_config
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
        block_table = cad.block_table_tensor  # [batch, max_blocks_per_req]
        rows = torch.arange(cad.batch_size(), device=self.device).repeat_interleave(num_spec)  # [batch * K]
        block_index = (positions // self.block_size).clamp(max=block_table.shape[1] - 1)  # [batch * K]
        return block_table[rows, block_index].to(torch.int64) * self.block_size + positions % self.block_size
