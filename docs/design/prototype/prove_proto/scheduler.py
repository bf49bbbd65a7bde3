"""Scheduler for lossy/MARS modes: a row that commits a tokens from a mask
window has KV for u + (a-1) *mask* positions; vLLM's rule (accepted =
len(generated)-1) would keep those as computed. Roll them back so the next
window re-feeds y_1..y_a as real tokens."""
from vllm.v1.core.sched.scheduler import Scheduler


class ProveScheduler(Scheduler):
    def update_from_output(self, scheduler_output, model_runner_output):
        sampled = model_runner_output.sampled_token_ids
        idx = model_runner_output.req_id_to_index
        res = super().update_from_output(scheduler_output, model_runner_output)
        if sampled:
            for req_id in scheduler_output.scheduled_spec_decode_tokens:
                req = self.requests.get(req_id)
                if req is None or req.is_finished() or req_id not in idx:
                    continue
                g = len(sampled[idx[req_id]])
                if g > 1:
                    req.num_computed_tokens -= g - 1
        return res
