"""Lossy ProVe (verifier gate) and MARS (tau rule) inside vLLM's V1 runner.

The served model is the proposer.  Drafts scheduled by vLLM are B-1 *mask*
tokens, so the target forward over [last token, masks] is the MARS window
pass.  `_sample` is replaced: y = argmax of the window logits, p~ = max
softmax; verifier mode teacher-forces the same token stream (masks replaced
by y) through the small verifier (vLLM's draft_model, own KV cache in the same
block table); the product gate commits y_1..y_a, nothing else is emitted.
The scheduler subclass (scheduler.py) then rolls num_computed_tokens back by
a-1 so the committed tokens are re-fed as real tokens in the next window.
"""
import torch
from vllm.forward_context import set_forward_context
from vllm.v1.outputs import SamplerOutput
from vllm.v1.spec_decode.draft_model import DraftModelProposer


def _cfg(vllm_config):
    ac = vllm_config.additional_config or {}
    return ac.get("prove", {}) if isinstance(ac, dict) else {}


def _mask_id(vllm_config):
    return int(vllm_config.model_config.hf_config.mask_token_id)


class MaskBlockProposer:
    """custom_class proposer (MARS mode): drafts are always B-1 masks."""
    def __init__(self, vllm_config):
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.mask = _mask_id(vllm_config)

    def load_model(self, target_model):
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, **kw):
        return [[self.mask] * self.k for _ in sampled_token_ids]


class VerifierProposer(DraftModelProposer):
    """draft_model slot holds the *verifier*; drafts are B-1 masks; the
    verifier forward is called by the runner's gate (verify())."""
    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        self.mask = _mask_id(vllm_config)

    def propose(self, num_speculative_tokens, target_token_ids, target_positions,
                target_hidden_states, next_token_ids, token_indices_to_sample,
                common_attn_metadata, sampling_metadata, **kw):
        self._last_draft_probs = None
        b = next_token_ids.shape[0]
        return torch.full((b, num_speculative_tokens), self.mask,
                          dtype=torch.int64, device=self.device)

    @torch.inference_mode()
    def verify(self, input_ids, positions, cad):
        n = input_ids.shape[0]
        _, per_layer = self.build_per_group_and_layer_attn_metadata(cad)
        slot = {name: cad.slot_mapping[:n] for name in self._draft_attn_layer_names}
        with set_forward_context(per_layer, self.vllm_config, num_tokens=n,
                                 slot_mapping=slot):
            h = self.model(input_ids=input_ids, positions=positions, inputs_embeds=None)
        return h


class ProveGateRunnerMixin:
    """Mixed into the live runner instance (CPUModelRunner or GPUModelRunner)."""

    def _input_fits_in_drafter(self, cad):
        # drafts are masks (no drafter forward): never replace them by zeros
        # near max_model_len; the scheduler already truncates spec tokens there.
        return True

    def sample_tokens(self, grammar_output):
        self._prove_state = self.execute_model_state
        try:
            return super().sample_tokens(grammar_output)
        finally:
            self._prove_state = None

    def _sample(self, logits, spec_decode_metadata):
        cfg = _cfg(self.vllm_config)
        mode = cfg.get("mode")
        state = self._prove_state
        scheduler_output, cad = state[0], state[3]
        n_tok = scheduler_output.total_num_scheduled_tokens
        ids = self.input_ids.gpu[:n_tok].clone()
        pos = self._get_positions(n_tok)
        if spec_decode_metadata is None:
            if mode == "verifier":          # keep the verifier's KV in sync (prefill)
                self.drafter.verify(ids, pos, cad)
            return super()._sample(logits, spec_decode_metadata)
        sm = self.input_batch.sampling_metadata
        assert sm.all_greedy, "prototype gate: greedy only"
        md = spec_decode_metadata
        lg = logits.float()
        probs = torch.softmax(lg, -1)
        p_tilde, y = probs.max(-1)                      # [rows]
        tgt_rows = md.target_logits_indices.long()      # rows whose next token is a mask
        li = md.logits_indices.long()
        if mode == "verifier":
            ids[li[tgt_rows + 1]] = y[tgt_rows].to(ids.dtype)   # masks -> y
            vh = self.drafter.verify(ids, pos, cad)
            vlog = self.drafter.model.compute_logits(vh[li]).float()
            q = torch.softmax(vlog, -1).gather(1, y[:, None]).squeeze(1)
            score = p_tilde * q
            thr = float(cfg.get("theta", 0.05))
        else:                                            # mars
            score = p_tilde
            thr = float(cfg.get("tau", 0.95))
        nreq = len(md.num_draft_tokens)
        out = torch.full((nreq, md.max_spec_len + 1), -1, dtype=torch.int32,
                         device=logits.device)
        start = 0
        log = self.__dict__.setdefault("_prove_log", [])
        for i, n in enumerate(md.num_draft_tokens):
            ok = (score[start + 1:start + n + 1] >= thr).tolist()
            a = 1
            for good in ok:
                if not good:
                    break
                a += 1
            out[i, :a] = y[start:start + a].to(torch.int32)
            log.append(a)
            start += n + 1
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=None)
