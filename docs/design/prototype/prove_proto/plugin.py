"""vllm.general_plugins entry point (prototype).

Runs in every vLLM process (front-end in EngineArgs.__post_init__, engine core
in EngineCore.__init__, worker in WorkerWrapperBase.init_worker *before* the
worker class is resolved).  It pins the vLLM version and, in the process that
builds the VllmConfig, injects worker_cls / scheduler_cls from
additional_config["prove"]."""
import os

PINNED = "0.32.0"


def _log(msg):
    with open("/tmp/proto/plugin_calls.log", "a") as f:
        import multiprocessing as mp
        f.write(f"{os.getpid()} {mp.current_process().name} {msg}\n")


def register():
    import vllm
    if vllm.__version__ != PINNED:
        raise RuntimeError(f"vllm-prove engine pins vllm=={PINNED}, found {vllm.__version__}; "
                           "install the pinned version or disable the plugin with VLLM_PLUGINS=''.")
    _log("register")
    # CPU: re-register the fixed expand kernel *after* the platform's own overrides
    from vllm.platforms import current_platform
    if current_platform.is_cpu():
        plat = type(current_platform)
        orig_reg = plat.register_triton_kernel_overrides
        if not getattr(orig_reg, "_prove", False):
            def reg(cls):
                orig_reg()
                from prove_proto import cpu_fixes
                if cpu_fixes.apply():
                    _log("cpu expand fix registered")
            reg = classmethod(reg); reg.__func__._prove = True
            plat.register_triton_kernel_overrides = reg
    from vllm.engine.arg_utils import EngineArgs
    if getattr(EngineArgs.create_engine_config, "_prove", False):
        return
    orig = EngineArgs.create_engine_config

    def create_engine_config(self, *a, **kw):
        ac = self.additional_config or {}
        prove = ac.get("prove") if isinstance(ac, dict) else None
        if prove is not None:
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")   # V1 runner on GPU too
        cfg = orig(self, *a, **kw)
        if prove is not None:
            from vllm.platforms import current_platform
            if cfg.parallel_config.worker_cls in ("auto", "vllm.v1.worker.cpu_worker.CPUWorker",
                                                 "vllm.v1.worker.gpu_worker.Worker"):
                assert current_platform.is_cpu(), "prototype: CPU worker only"
                cfg.parallel_config.worker_cls = "prove_proto.worker.ProveCPUWorker"
            if prove.get("mode") in ("verifier", "mars") and cfg.scheduler_config.scheduler_cls in (None, "vllm.v1.core.sched.scheduler.Scheduler"):
                cfg.scheduler_config.scheduler_cls = "prove_proto.scheduler.ProveScheduler"
            _log(f"injected worker_cls={cfg.parallel_config.worker_cls} scheduler_cls={cfg.scheduler_config.scheduler_cls}")
        return cfg

    create_engine_config._prove = True
    EngineArgs.create_engine_config = create_engine_config
