"""The gated modes inside vLLM's V1 model runner: the gate sits where the rejection sampler was.

``GPUModelRunner._sample`` (``vllm/v1/worker/gpu_model_runner.py:3437``) is the one call site
of ``RejectionSampler`` and there is no pluggable acceptance rule in V1, so the worker mixes
``ProveGateRunnerMixin`` into the live runner (``CPUModelRunner`` subclasses it). The mixin

- keeps the step's scheduler output and attention metadata, which ``sample_tokens``
  unpacks and clears before calling ``_sample`` (l.4317-4331);
- replaces ``_sample`` on steps with windows by the cycle of ``gate.py``: ``y, p~`` from the
  window logits, ``q`` from one verifier pass, the core's gate, vLLM's output layout;
- runs the verifier over every step's tokens, windows or not, so its KV cache (vLLM's
  draft-model cache in the same block table) holds the same real tokens as the proposer's;
- skips the drafter pass: the scheduler lays out each window's masks itself
  (``ProveScheduler``), so the runner only hands back masks;
- serves the requests the gate cannot decode exactly (the fallback path, ``requests``) in the
  same step: their rows (no window) take vLLM's own sampler output, logprobs included.
"""

from __future__ import annotations

import torch
from vllm.forward_context import set_forward_context
from vllm.v1.outputs import SamplerOutput

from vllm_prove.config import EngineMode, ProveEngineConfig
from vllm_prove.core import fused
from vllm_prove.engine import gate
from vllm_prove.engine.requests import request_gate_serves

# Index of SchedulerOutput and of the spec-decode CommonAttentionMetadata in the
# execute_model_state tuple unpacked by sample_tokens (gpu_model_runner.py:4317-4328).
STATE_SCHEDULER_OUTPUT = 0
STATE_COMMON_ATTN_METADATA = 3


@torch.inference_mode()
def run_verifier(
    drafter,  # vLLM's DraftModelProposer holding the verifier and its KV layers
    # [num_scheduled_tokens]
    input_ids: torch.Tensor,
    # [num_scheduled_tokens]
    positions: torch.Tensor,
    common_attn_metadata,
) -> torch.Tensor:  # [num_scheduled_tokens, verifier_hidden]
    """One teacher-forced verifier pass over the step's tokens, writing the verifier's KV.

    The verifier's attention layers are in the target's KV-cache group (same block table and
    slot mapping), so the target's metadata is rebuilt for them
    (``llm_base_proposer.py:988``) and their slots are the target's
    (``attention.py:680-746`` reads both from the forward context).
    """
    num_tokens = input_ids.shape[0]
    _, per_layer_metadata = drafter.build_per_group_and_layer_attn_metadata(common_attn_metadata)
    slot_mapping = {name: common_attn_metadata.slot_mapping[:num_tokens] for name in drafter._draft_attn_layer_names}
    with set_forward_context(per_layer_metadata, drafter.vllm_config, num_tokens=num_tokens, slot_mapping=slot_mapping):
        return drafter.model(input_ids=input_ids, positions=positions, inputs_embeds=None)


class ProveGateRunnerMixin:
    """Mixed into the live ``GPUModelRunner`` / ``CPUModelRunner`` of a gated mode."""

    prove: ProveEngineConfig  # set by worker.install_gate_runner
    _prove_state: tuple | None = None

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        # No drafter pass runs (the window is the scheduler's), so vLLM's margin for one
        # (gpu_model_runner.py:4288, drafts zeroed near max_model_len) does not apply.
        return True

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs) -> torch.Tensor:
        """``[num_reqs, B - 1]`` masks; ProveScheduler lays out the next window itself."""
        num_reqs = len(self.input_batch.req_ids)
        return torch.full((num_reqs, self.num_spec_tokens), self.prove.mask_token_id, dtype=torch.int32, device=self.device)

    def sample_tokens(self, grammar_output):
        self._prove_state = self.execute_model_state
        try:
            return super().sample_tokens(grammar_output)
        finally:
            self._prove_state = None

    def _sample(self, logits: torch.Tensor | None, spec_decode_metadata) -> SamplerOutput:
        scheduler_output = self._prove_state[STATE_SCHEDULER_OUTPUT]
        common_attn_metadata = self._prove_state[STATE_COMMON_ATTN_METADATA]
        num_tokens = scheduler_output.total_num_scheduled_tokens
        input_ids = self.input_ids.gpu[:num_tokens]  # [num_tokens]
        positions = self._get_positions(num_tokens)  # [num_tokens]
        if spec_decode_metadata is None:
            # Defensive: vLLM builds spec-decode metadata for every step of a speculative
            # engine (gpu_model_runner.py:2184-2224), windows or not; rows without drafts
            # then commit y_1, the argmax, through the gate below.
            if self.prove.mode is EngineMode.VERIFIER:
                run_verifier(self.drafter, input_ids, positions, common_attn_metadata)
            return super()._sample(logits, spec_decode_metadata)
        fallback = self._fallback_rows()
        if not fallback:
            return self._gate(logits, spec_decode_metadata, input_ids, positions, common_attn_metadata)
        # vLLM's sampler over every row (on a copy: its processors may write into the logits),
        # then the gate (one verifier pass for the whole step); the fallback rows keep vLLM's.
        sampled = super()._sample(logits.clone(), spec_decode_metadata)
        gated = self._gate(logits, spec_decode_metadata, input_ids, positions, common_attn_metadata)
        token_ids = gated.sampled_token_ids.clone()  # [num_reqs, max_spec_len + 1]
        rows = torch.tensor(fallback, device=token_ids.device)
        token_ids[rows] = sampled.sampled_token_ids[rows].to(token_ids.dtype)
        return SamplerOutput(sampled_token_ids=token_ids, logprobs_tensors=sampled.logprobs_tensors)

    def _fallback_rows(self) -> list[int]:
        """Batch rows of the requests the gate does not serve (no window, vLLM's sampler)."""
        return [i for i, req_id in enumerate(self.input_batch.req_ids)
                if req_id is not None and not request_gate_serves(self.requests[req_id])]

    def _gate(
        self,
        # [num_rows, vocab]: window logits
        logits: torch.Tensor,
        spec_decode_metadata,
        # [num_tokens]
        input_ids: torch.Tensor,
        # [num_tokens]
        positions: torch.Tensor,
        common_attn_metadata,
    ) -> SamplerOutput:
        """Propose (window logits), verify (one verifier pass), gate, commit: one cycle."""
        md = spec_decode_metadata
        draft_token_ids, proposer_probs = gate.propose_from_window(logits)  # [num_rows] each
        verifier_probs = None
        if self.prove.mode is EngineMode.VERIFIER:
            ids = gate.verifier_input_ids(input_ids, draft_token_ids, md.logits_indices, md.target_logits_indices)
            hidden = run_verifier(self.drafter, ids, positions, common_attn_metadata)  # [num_tokens, hidden]
            verifier_logits = self.drafter.model.compute_logits(hidden[md.logits_indices])  # [num_rows, vocab]
            verifier_probs = fused.token_prob(verifier_logits, draft_token_ids)  # [num_rows]
        verdict = gate.apply_window_gate(
            self.prove.gate_kind, self.prove.threshold, draft_token_ids, proposer_probs, verifier_probs,
            md.cu_num_sampled_tokens, md.max_spec_len + 1,
        )
        return SamplerOutput(sampled_token_ids=gate.sampled_token_ids(verdict, md.max_spec_len), logprobs_tensors=None)


def gate_runner_class(runner_cls: type) -> type:
    """``runner_cls`` with the gate mixed in (one class per runner class)."""
    return type(f"Prove{runner_cls.__name__}", (ProveGateRunnerMixin, runner_cls), {})
