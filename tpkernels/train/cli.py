"""``tpkernels train``: run a TrainConfig under torchrun, or launch ``--nproc`` local ranks itself.

    tpkernels train --config run.yaml                       # one process
    tpkernels train --config run.yaml --nproc 4 --parallel.tp 2 --parallel.pp 2 --parallel.sequence_parallel
    torchrun --nproc-per-node 8 -m tpkernels.train --config run.yaml
    tpkernels train --config run.yaml --dry-run             # validate and print the plan only

``--nproc`` goes through torch's elastic launcher (:mod:`tpkernels.train.launch`), the same code
path as ``torchrun --standalone``.
"""

from __future__ import annotations

import os
import sys

from tpkernels.train.config import TrainConfig, add_flags, flag_values


def add_parser(sub) -> None:
    add_arguments(sub.add_parser("train", help="train a GPT-2 / Llama-family model at a TP×PP×DP layout"))


def add_arguments(p) -> None:
    p.add_argument("--config", help="YAML or TOML file of TrainConfig keys (flags override it)")
    p.add_argument("--nproc", type=int, default=None,
                   help="launch this many local ranks (torch's elastic launcher; gloo without GPUs)")
    p.add_argument("--dry-run", action="store_true", help="validate the config and layout, print them, do not train")
    p.add_argument("--verify-step0", action="store_true",
                   help="with --nproc: check step 0's loss against the single-process fp64 model on the whole "
                        "global batch at once (the token mean every layout must give)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="with --nproc: restart the ranks this many times after a failure (torchrun's --max-restarts); "
                        "each restart resumes from the latest complete checkpoint in save_dir")
    p.add_argument("--debug", action="store_true", help="show errors with their tracebacks (and the launcher's log)")
    add_flags(p)
    from tpkernels.options import suggest_unknown_flags  # noqa: PLC0415

    suggest_unknown_flags(p)  # '--stepz' -> did you mean '--steps' (training.steps), as for a file's key


def dry_run(cfg: TrainConfig, world: int, *, read_data: bool = True, epochs: float | None = None) -> str:
    """What the run would check before its first step (the model, the layout, the data), printed.
    ``read_data=False``: the data's paths, tokenizer and vocabulary only, not the tokenized corpus
    (before a launch, whose ranks each read it). ``epochs``: the ``training.epochs`` its steps were made from."""
    from tpkernels.train.data import check_source, data_of  # noqa: PLC0415
    from tpkernels.train.output_paths import check_output_paths  # noqa: PLC0415

    mc = cfg.model_config()
    check_output_paths(cfg)
    cfg.parallel.validate(world_size=world, key_prefix="parallel.", **mc.layout_rules(cfg.data.seq_length))
    pc = cfg.parallel_config(world)
    said = ""
    if read_data:
        from tpkernels.train.run_length import data_summary, epochs_line  # noqa: PLC0415

        data = data_of(cfg, mc.vocab_size, pc.global_batch_size)
        said = "".join(f"\n{x}" for x in (data_summary(data), epochs_line(cfg, data, pc.global_batch_size, epochs)) if x)
    else:
        check_source(cfg, mc.vocab_size)
    cp = ""
    if pc.cp > 1:
        L = cfg.data.seq_length // (2 * pc.cp)
        shares = ", ".join(f"CP rank {r}: [{r * L}, {(r + 1) * L}) + [{(2 * pc.cp - 1 - r) * L}, {(2 * pc.cp - r) * L})"
                           for r in range(pc.cp))
        cp = f"\ncontext parallel: {pc.cp} ranks, {pc.cp_algo} attention, zigzag chunks of {L} tokens: {shares}"
    from tpkernels.train.memory_guard import run_memory  # noqa: PLC0415

    return (f"model: {mc.describe()}\nlayout: {pc.short()} on {world} rank(s), schedule {pc.pipeline_schedule}, "
            f"global batch {pc.global_batch_size} × {cfg.data.seq_length} tokens{cp}{said}\n"
            f"{run_memory(cfg, world).describe(verdict=True)}\nconfig: {cfg.dumps()}")


def single_process_loss(cfg: TrainConfig, global_batch: int) -> float:
    """Step 0's loss of ``cfg`` from the whole global batch at once (one micro-batch of ``global_batch``
    rows), by the single-process model in float64: the token mean over the batch that every layout,
    micro-batching and data-parallel split must reproduce. Weights: the run's initial ones (its seed,
    or ``model.init_from``; LoRA adapters start as a no-op)."""
    import torch  # noqa: PLC0415

    from tpkernels.models import ParallelTransformer  # noqa: PLC0415
    from tpkernels.parallel import ParallelConfig  # noqa: PLC0415
    from tpkernels.parallel.state import ParallelState  # noqa: PLC0415
    from tpkernels.train.data import data_of  # noqa: PLC0415

    mc = cfg.model_config()
    state = ParallelState.create(ParallelConfig(micro_batch_size=global_batch, num_microbatches=1, dp=1))
    if cfg.model.init_from:
        model = ParallelTransformer.from_hf(cfg.model.init_from, state, config=mc, dtype=torch.float64)
    else:
        model = ParallelTransformer(mc, state, seed=cfg.training.seed, dtype=torch.float64)
    data = data_of(cfg, mc.vocab_size)
    batch = data.batch(0, global_batch)
    task = cfg.training.task if cfg.training.task != "auto" else getattr(data, "task", "pretrain")
    if task == "dpo":
        return _dpo_step0(cfg, model, state, batch)
    return model.evaluate(batch.ids, batch.targets(), position_ids=batch.position_ids, num_microbatches=1)


def _dpo_step0(cfg, model, state, batch) -> float:
    """DPO's step-0 loss of the whole batch: the reference is the initial model itself (its log-probs
    computed here, by a separate forward pass), so the loss tests the pairing, the masks, the SFT term
    and SimPO's normalisation, whatever the run's layout."""
    from tpkernels.functional.preference import REFERENCE_FREE  # noqa: PLC0415
    from tpkernels.models.preference import PreferenceObjective, SequenceLogps  # noqa: PLC0415
    from tpkernels.train.dpo import PairInfo  # noqa: PLC0415

    d, target = cfg.dpo, batch.targets()
    info = PairInfo.of(batch, target)
    t = {"target": target, "doc": info.doc}
    ref = None
    if d.loss_type not in REFERENCE_FREE:
        rec = SequenceLogps(model.head, state)
        rec.begin(info.num_pairs)
        model.evaluate(batch.ids, t, batch.position_ids, num_microbatches=1, loss_fn=rec, num_targets=info.num_pairs)
        ref = rec.result()
    obj = PreferenceObjective(model.head, state, beta=d.beta, loss_type=d.loss_type, label_smoothing=d.label_smoothing,
                              sft_weight=d.sft_weight, simpo_gamma=d.simpo_gamma)
    obj.begin_step(info.num_pairs, info.chosen_tokens, ref)
    return model.evaluate(batch.ids, t, batch.position_ids, num_microbatches=1, loss_fn=obj,
                          num_targets=info.num_pairs)


def prediction_report(predicted: dict, history: list[dict]) -> str:
    steps = history[1:] or history
    from tpkernels.train.metrics import median  # noqa: PLC0415

    measured, bubble, comm = (median([h[k] for h in steps]) for k in ("step_s", "bubble", "comm_ratio"))
    return (f"planner vs measured ({predicted['layout']}): step {predicted['step_s']:.3g} s vs {measured:.3g} s "
            f"(median), bubble {100 * predicted['bubble']:.0f}% vs {100 * bubble:.0f}% (rank 0's idle share), "
            f"comm/compute {100 * predicted['comm_ratio']:.0f}% vs {100 * comm:.0f}% (worst rank, exposed TP and CP)")


def rank_main(cfg: TrainConfig, candidates=None) -> list[dict]:
    """What each rank runs, under torchrun or the ``--nproc`` launcher: train, report on rank 0.
    ``candidates`` (layout auto with autotune): (the planner's ranked candidates, how many to try)."""
    from tpkernels.train.experiment_log import close_logs  # noqa: PLC0415
    from tpkernels.train.progress import run_summary  # noqa: PLC0415
    from tpkernels.train.trainer import Trainer  # noqa: PLC0415
    from tpkernels.train.voice import install_warning_voice  # noqa: PLC0415

    install_warning_voice(int(os.environ.get("RANK", 0)))

    if candidates:
        from tpkernels.train.autotune import train_autotuned  # noqa: PLC0415

        history = train_autotuned(cfg, *candidates)
        if int(os.environ.get("RANK", 0)) == 0 and history:
            print(run_summary(cfg, history, layout="autotuned run"), flush=True)
        close_logs()
        return history
    trainer = Trainer(cfg)
    history = trainer.train()
    if trainer.is_logger and history:
        if cfg.predicted:
            print(prediction_report(cfg.predicted, history), flush=True)
        print(run_summary(cfg, history, layout=trainer.pc.short(), peak_label=trainer.peak_label), flush=True)
    close_logs()  # the TensorBoard / wandb writers: their last events on disk
    return history


def _resolve_epochs(cfg: TrainConfig, world: int) -> TrainConfig:
    """``training.epochs`` as steps at the run's global batch (layout auto keeps the config's own)."""
    from tpkernels.train.data import data_of  # noqa: PLC0415
    from tpkernels.train.run_length import resolve_epochs  # noqa: PLC0415

    if cfg.layout == "auto":
        from tpkernels.train.auto_layout import run_global_batch  # noqa: PLC0415

        batch = run_global_batch(cfg, world)[0]
    else:
        batch = cfg.parallel_config(world).global_batch_size
    return resolve_epochs(cfg, data_of(cfg, cfg.model_config().vocab_size), batch)


def _world(args) -> int:
    return args.nproc or int(os.environ.get("WORLD_SIZE", 1))


def run(args) -> int:
    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc ({args.nproc}) must be a positive integer")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts ({args.max_restarts}) must be >= 0")
    if args.max_restarts and not args.nproc:
        raise ValueError(f"--max-restarts ({args.max_restarts}) needs --nproc (under torchrun, give torchrun's own "
                         "--max-restarts)")
    from tpkernels.train.voice import install_warning_voice  # noqa: PLC0415

    install_warning_voice(int(os.environ.get("RANK", 0)))  # the config's and the data's warnings, one line each
    cfg = TrainConfig.load(args.config, flag_values(args), text_overrides=True)
    epochs = cfg.training.epochs
    if epochs is not None:  # the run's length from the data's rows, before any plan or budget
        cfg = _resolve_epochs(cfg, _world(args))
    candidates = None
    if cfg.layout == "auto":
        from tpkernels.train.auto_layout import apply_plan, explain, plan_layout  # noqa: PLC0415

        best, p = plan_layout(cfg, _world(args))
        note = ""
        if cfg.autotune.candidates:
            from tpkernels.train.autotune import (  # noqa: PLC0415
                candidates_from_plan, manual_candidate, trial_budget, with_manual)

            # the config's own layout, if it sets one, is tried with the planner's K (budget permitting)
            mine, note = manual_candidate(cfg, p, _world(args))
            # the budget's first K are tried; the rest of the ranking is where the refit planner may look
            tries = trial_budget(cfg, cfg.autotune.candidates + (mine is not None))
            candidates = (with_manual(candidates_from_plan(cfg, p, max(tries, 20)), tries, mine), tries)
        cfg = apply_plan(cfg, best)
        if int(os.environ.get("RANK", 0)) == 0:
            print(explain(p), flush=True)
            if note:
                print(f"autotune: {note}", flush=True)
            if candidates:
                print(f"autotune: trying {', '.join(c.parallel.short() for c in candidates[0][:tries])} on these "
                      "ranks", flush=True)
    if args.dry_run:
        print(dry_run(cfg, _world(args), epochs=epochs))
        return 0
    if "RANK" not in os.environ or os.environ.get("LOCAL_RANK", "0") == "0":  # one check per host, before any build
        from tpkernels.train.memory_guard import check_memory  # noqa: PLC0415

        # the config's errors (data paths, layout) first, once, before the estimate and any rank start
        dry_run(cfg, _world(args), read_data=False)
        check_memory(cfg, _world(args))
    if args.nproc:
        from tpkernels.train.launch import launch  # noqa: PLC0415

        history = launch(rank_main, args.nproc, cfg, candidates, max_restarts=args.max_restarts,
                         quiet=not args.debug)[0]
        if args.verify_step0:
            pc = cfg.parallel_config(args.nproc)
            want = single_process_loss(cfg, pc.global_batch_size)
            got = history[0]["loss"]
            ok = abs(got - want) <= 1e-5 * max(1.0, abs(want)) if cfg.training.precision in ("fp32", "fp64") else \
                abs(got - want) <= 2e-2 * abs(want)
            print(f"step 0 loss {got:.6f} at {pc.short()} vs {want:.6f} from the single-process fp64 model on the "
                  f"whole batch at once: {'equal' if ok else 'DIFFERENT'} (|difference| {abs(got - want):.1e})")
            if not ok:
                return 1
        return 0
    if "RANK" in os.environ:  # torchrun
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        from tpkernels.train.failures import close_process_groups  # noqa: PLC0415

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        try:
            rank_main(cfg, candidates)
        finally:
            close_process_groups()  # not again after a lost rank's abort: one clean message
        return 0
    rank_main(cfg, candidates)
    return 0


def run_reporting_errors(args) -> int:
    """:func:`run`, with a bad config or layout as one line naming the rule (exit 2) and a failed rank
    as one line naming it (exit 1), not a traceback."""
    import torch  # noqa: PLC0415

    from tpkernels.parallel.config import ParallelConfigError  # noqa: PLC0415
    from tpkernels.train.failures import RankLostError  # noqa: PLC0415
    from tpkernels.train.launch import LaunchError  # noqa: PLC0415

    from tpkernels.train.checkpoint import CheckpointSaveError  # noqa: PLC0415

    if getattr(args, "debug", False):
        return run(args)
    try:
        return run(args)
    except (ValueError, ParallelConfigError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
            PermissionError) as e:
        print(f"tpkernels train: error: {e}", file=sys.stderr)
        return 2
    except LaunchError as e:
        # a rank's bad input is a bad input (exit 2), said once; a rank that died is a failed run (exit 1)
        bad_input = e.kind in ("ValueError", "ParallelConfigError", "CheckpointError", "FileNotFoundError",
                               "NotADirectoryError", "IsADirectoryError", "PermissionError")
        print(f"tpkernels train: error: {e.detail if bad_input else e}", file=sys.stderr)
        return 2 if bad_input else 1
    except (FloatingPointError, RankLostError, torch.OutOfMemoryError, CheckpointSaveError) as e:
        # a failed run: its message says where and what to do (the loss went NaN, a rank was lost, ...)
        print(f"tpkernels train: error: {e}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    """``python -m tpkernels.train``: the same arguments and errors as ``tpkernels train``."""
    import argparse  # noqa: PLC0415

    from tpkernels.train.launch import start_workers_early  # noqa: PLC0415

    argv = sys.argv[1:] if argv is None else list(argv)
    start_workers_early(argv)  # with --nproc, as tpkernels train does
    ap = argparse.ArgumentParser(prog="python -m tpkernels.train", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return run_reporting_errors(ap.parse_args(argv))
