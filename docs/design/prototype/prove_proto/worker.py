"""Worker swap: build the stock runner, then install the ProVe drafter."""
from vllm.logger import init_logger
from vllm.v1.worker.cpu_worker import CPUWorker

logger = init_logger(__name__)


def _prove_cfg(vllm_config):
    ac = vllm_config.additional_config or {}
    return ac.get("prove", {}) if isinstance(ac, dict) else {}


class ProveCPUWorker(CPUWorker):
    def init_device(self):
        super().init_device()
        cfg = _prove_cfg(self.vllm_config)
        if cfg.get("fix_cpu_expand", True):
            from prove_proto import cpu_fixes
            cpu_fixes.apply()
        r = self.model_runner
        if cfg.get("mode", "lossless") == "lossless" and hasattr(r, "drafter") and cfg.get("self_proposer", True):
            from prove_proto.self_proposer import SelfMaskProposer
            r.drafter = SelfMaskProposer(self.vllm_config, r.device, r)
            logger.info("ProVe: installed SelfMaskProposer in %s", type(r).__name__)
        if cfg.get("mode") in ("verifier", "mars"):
            from prove_proto.gate import ProveGateRunnerMixin, VerifierProposer
            r.__class__ = type("Prove" + type(r).__name__, (ProveGateRunnerMixin, type(r)), {})
            if cfg["mode"] == "verifier":
                r.drafter = VerifierProposer(self.vllm_config, r.device, r)
