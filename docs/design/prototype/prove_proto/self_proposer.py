"""Lossless mask-pass self-proposer: the served model drafts its own block
with one pass over [next_token, mask x (K-1)] in its *own* KV cache.

Rides on vLLM's draft_model + parallel_drafting pipeline (lookahead slots,
padded drafter batch, draft_probs hand-off), but:
  * load_model: no second weights -- self.model is the target nn.Module;
  * the "draft layers" are the target's own attention layers -> no extra
    KV-cache spec is ever registered, so no second KV cache;
  * set_inputs_first_pass: feed only [next_token, masks] (K tokens/request),
    never re-feed the target's tokens (they are already in the cache).
"""
import torch
from vllm.config import get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.spec_decode.utils import PADDING_SLOT_ID

logger = init_logger(__name__)


class SelfMaskProposer(DraftModelProposer):
    def __init__(self, vllm_config, device, runner=None):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        assert self.parallel_drafting, "SelfMaskProposer needs parallel_drafting"
        self.mask_token_id = self.parallel_drafting_token_id
        K = self.num_speculative_tokens
        self._k_arange = torch.arange(K, dtype=torch.int64, device=device)
        self.stats_steps = 0

    # ---- weights / KV sharing -------------------------------------------
    def load_model(self, target_model):
        layers = get_layers_from_vllm_config(self.vllm_config, AttentionLayerBase)
        self._draft_attn_layer_names = {
            n for n, l in layers.items()
            if l.get_kv_cache_spec(self.vllm_config) is not None
        }
        self.model = target_model          # same nn.Module, same weights
        self.supports_mm_inputs = False
        logger.info("SelfMaskProposer: sharing target model + KV layers %s",
                    sorted(self._draft_attn_layer_names))

    # ---- input layout: [next_token, mask * (K-1)] per request --------------
    def set_inputs_first_pass(self, target_token_ids, next_token_ids,
                              target_positions, target_hidden_states,
                              token_indices_to_sample, cad,
                              num_rejected_tokens_gpu):
        K = self.num_speculative_tokens
        B = cad.batch_size()
        seq_lens = cad.seq_lens.to(torch.int64)
        if num_rejected_tokens_gpu is not None:
            start = seq_lens - num_rejected_tokens_gpu.to(torch.int64)
        else:
            start = seq_lens
        pos = (start[:, None] + self._k_arange[None, :K])            # [B, K]
        n = B * K
        ids = torch.full((B, K), self.mask_token_id, dtype=torch.int32,
                         device=self.device)
        ids[:, 0] = next_token_ids.to(torch.int32)
        self.input_ids[:n] = ids.view(-1)
        flat_pos = pos.view(-1)
        clamped = flat_pos.clamp(max=self.max_model_len - 1)
        self.positions[:n] = clamped
        bt = cad.block_table_tensor
        nblk = bt.shape[1]
        bidx = (clamped // self.block_size).clamp(max=nblk - 1)
        req = torch.arange(B, device=self.device).repeat_interleave(K)
        slots = bt[req, bidx].to(torch.int64) * self.block_size + clamped % self.block_size
        slots = slots.masked_fill(flat_pos >= self.max_model_len, PADDING_SLOT_ID)
        qsl = torch.arange(B + 1, dtype=torch.int32, device=self.device) * K
        new_seq = (start + K).clamp(max=self.max_model_len).to(cad.seq_lens.dtype)
        ub = cad.seq_lens_cpu_upper_bound
        new_cad = cad.replace(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl.cpu(),
            seq_lens=new_seq,
            seq_lens_cpu_upper_bound=None if ub is None else ub + K,
            num_actual_tokens=n,
            max_query_len=K,
            max_seq_len=min(cad.max_seq_len + K, self.max_model_len),
            slot_mapping=slots,
            causal=True,
            positions=None,
            is_prefilling=None,
        )
        tis = torch.arange(n, dtype=torch.int32, device=self.device)
        self.stats_steps += 1
        return n, tis, new_cad
