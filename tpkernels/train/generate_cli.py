"""``tpkernels generate``: text from a training checkpoint (any finetune kind) or a Hugging Face folder,
at any TP layout.

    tpkernels generate runs/sft --prompt "Once upon a time" --max-new-tokens 40
    tpkernels generate runs/sft --prompts prompts.jsonl --nproc 2 --temperature 0.7 --top-p 0.9 --json
    tpkernels generate path/to/hf_model --chat                       # a conversation, turn by turn

``--nproc N`` launches N local ranks through torch's elastic launcher (tpkernels.train.launch, as
``tpkernels train --nproc`` does): the model is split over them with TP N (each rank holds its heads
and its KV cache); under ``torchrun`` the world size is the TP size. TP rank 0 reads the input,
chooses the tokens and prints; the others compute their shards (tpkernels.generate.engine).

A prompts file holds one JSON value a line: a string, {"prompt": ...} (or "text"), or
{"messages": [...]} (a conversation, rendered with the tokenizer's chat template). ``--chat`` reads
one user message a line from stdin and re-renders the whole conversation through the chat template
each turn (a template may render an earlier reply otherwise than it was sampled, so the cache is
refilled from the rendered conversation rather than extended); ``/reset`` starts a new conversation,
``/exit`` or end of input ends.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
from pathlib import Path

from tpkernels.generate.text import read_prompts


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="sample text from a checkpoint or a Hugging Face folder at any TP layout")
    p.add_argument("checkpoint", help="a checkpoint folder (step_NNNNNNNN), the save_dir holding them, or a Hugging "
                                      "Face model folder (config.json + safetensors)")
    src = p.add_argument_group("input (one of)")
    src.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    src.add_argument("--prompts", help="a JSONL file: a string, {\"prompt\": ...} or {\"messages\": [...]} a line")
    src.add_argument("--chat", action="store_true", help="interactive: one user message a line from stdin, through "
                                                         "the tokenizer's chat template")
    p.add_argument("--system", default=None, help="with --chat: a system message opening the conversation")
    p.add_argument("--tokenizer", default=None, help="tokenizer (a tokenizers JSON or HF folder); default: the run's "
                                                     "data.tokenizer (byte-level if none), or the HF folder's own")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely tokens summing to p (1: all)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 penalises tokens already in the row")
    p.add_argument("--stop", action="append", default=[], help="stop when the reply holds this text (repeatable); "
                                                               "EOS and end-of-turn tokens always stop")
    p.add_argument("--seed", type=int, default=0, help="the sampling generator's seed")
    p.add_argument("--dtype", default="auto", help="auto (the run's precision on a GPU, fp32 on the CPU), float32, "
                                                   "bfloat16, float16, float64")
    p.add_argument("--nproc", type=int, default=None, help="launch this many local ranks: the TP size")
    p.add_argument("--json", action="store_true", help="one JSON line per prompt (prompt, completion, tokens, reason)")
    p.add_argument("--debug", action="store_true", help="show errors with their tracebacks")
    from tpkernels.options import suggest_unknown_flags  # noqa: PLC0415

    suggest_unknown_flags(p)  # '--promptt' -> did you mean '--prompt', as tpkernels train says


# ---- the input, checked in the launching process before any rank starts ----

def check_tp(kind: str, folder, tp: int) -> None:
    """The model must split over ``tp`` ranks (heads, KV heads): said before any rank starts."""
    from tpkernels.description import ModelConfig  # noqa: PLC0415
    from tpkernels.parallel import ParallelConfig  # noqa: PLC0415
    from tpkernels.parallel.config import ParallelConfigError  # noqa: PLC0415
    from tpkernels.train.checkpoint import read_meta, saved_model  # noqa: PLC0415

    mc = saved_model(read_meta(folder)) if kind == "checkpoint" else ModelConfig.from_hf(str(folder),
                                                                                         drop_dropout=True)
    try:
        ParallelConfig(tp=tp).validate(world_size=tp, **mc.layout_rules())
    except ParallelConfigError as e:
        lines = [x.strip().removeprefix("- ") for x in str(e).splitlines()]
        rules = "; ".join(x for x in lines[1:] if x) or lines[0]
        raise ValueError(f"--nproc ({tp}) is the TP size of generation, which this model cannot take: {rules}") \
            from None


def generation_eos(folder) -> list[int]:
    """The ``eos_token_id`` (one or a list) of a Hugging Face folder's generation_config.json (Llama 3 lists its
    end-of-turn ids there), or none."""
    if folder is None:
        return []
    path = Path(folder) / "generation_config.json"
    try:
        eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    except (OSError, ValueError, AttributeError):
        raise ValueError(f"{path} is not a JSON mapping") from None
    eos = [eos] if isinstance(eos, int) else (eos or [])
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in eos):
        raise ValueError(f"{path}: eos_token_id ({eos!r}) must be an integer or a list of them")
    return list(eos)


def options(args) -> dict:
    """The checked options of one generate command (what every rank is given)."""
    from tpkernels.generate.text import TextCodec  # noqa: PLC0415
    from tpkernels.train.checkpoint import config_of, read_meta  # noqa: PLC0415
    from tpkernels.train.generate_load import DTYPE_NAMES, resolve  # noqa: PLC0415

    kind, folder = resolve(args.checkpoint)
    given = [bool(args.prompt), args.prompts is not None, args.chat]
    if sum(given) != 1:
        raise ValueError("give exactly one input: --prompt TEXT (repeatable), --prompts FILE.jsonl or --chat")
    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc ({args.nproc}) must be a positive integer")
    if args.nproc and args.nproc > 1:
        check_tp(kind, folder, args.nproc)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens ({args.max_new_tokens}) must be >= 1")
    if args.dtype != "auto" and args.dtype not in DTYPE_NAMES:
        raise ValueError(f"--dtype ({args.dtype!r}) must be auto or one of {', '.join(DTYPE_NAMES)}")
    if any(not s for s in args.stop):
        raise ValueError("--stop must not be empty")
    from tpkernels.generate.sampling import Sampling  # noqa: PLC0415  (torch: after the arguments are checked)

    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.repetition_penalty)
    except ValueError as e:  # named as the flags are
        msg = str(e)
        for key in ("temperature", "top_k", "top_p", "repetition_penalty"):
            if msg.startswith(key + " ("):
                msg = "--" + key.replace("_", "-") + msg[len(key):]
        raise ValueError(msg) from None
    prompts = list(args.prompt) if args.prompt else (read_prompts(args.prompts) if args.prompts else [])
    if any(isinstance(p, str) and not p for p in prompts):
        raise ValueError("--prompt must not be empty")
    model_folder = folder if kind == "hf" else config_of(read_meta(folder)).model.init_from
    tokenizer = args.tokenizer
    if tokenizer is None:
        tokenizer = config_of(read_meta(folder)).data.tokenizer if kind == "checkpoint" else (
            str(folder) if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")) else None)
        if kind == "hf" and tokenizer is None:
            raise ValueError(f"{str(folder)!r} holds no tokenizer (tokenizer.json / tokenizer_config.json): give "
                             "--tokenizer")
    codec = TextCodec.load(tokenizer, "--tokenizer" if args.tokenizer else "tokenizer")
    if (args.chat or any(isinstance(p, list) for p in prompts)) and not codec.has_chat_template:
        codec.chat([])  # the named error: no chat template
    return {"path": str(folder), "tokenizer": tokenizer, "prompts": prompts, "chat": args.chat,
            "eos": generation_eos(model_folder),
            "system": args.system, "max_new_tokens": args.max_new_tokens, "sampling": sampling, "stop": list(args.stop),
            "seed": args.seed, "dtype": args.dtype, "json": args.json}


# ---- every rank ----

def rank_main(opts: dict, chat_input: str | None = None) -> list[dict] | None:
    """Build the TP layout of this world, load the model, generate; rank 0 prints and returns the results."""
    import torch.distributed as dist  # noqa: PLC0415

    from tpkernels.generate import Generator, TextCodec  # noqa: PLC0415
    from tpkernels.parallel import ParallelConfig  # noqa: PLC0415
    from tpkernels.parallel.state import ParallelState  # noqa: PLC0415
    from tpkernels.train.generate_load import load_for_generation  # noqa: PLC0415

    world = dist.get_world_size() if dist.is_initialized() else 1
    state = ParallelState.create(ParallelConfig(tp=world))  # TP over every rank
    loaded = load_for_generation(opts["path"], state, dtype=opts["dtype"])
    gen = Generator(loaded.model)
    codec = TextCodec.load(opts["tokenizer"]) if gen.is_chooser else None
    if gen.is_chooser and not opts["json"]:
        print(f"generating from {loaded.describe} at TP {world}", file=sys.stderr, flush=True)
    if opts["chat"]:
        chat_loop(gen, codec, opts, chat_input)
        return None
    return generate_prompts(gen, codec, opts)


def _stop_ids(codec, opts: dict) -> set:
    """The tokenizer's EOS and end-of-turn ids, and the model's generation_config.json eos_token_id."""
    return (set(codec.stop_ids) if codec is not None else set()) | set(opts.get("eos", []))


def encode(gen, codec, prompt, opts: dict) -> list[int]:
    """A prompt's ids (a conversation through the chat template); ids past the model's vocabulary name the
    tokenizer (a run trained with another one)."""
    ids = codec.chat(prompt) if isinstance(prompt, list) else codec.encode(prompt)
    vocab = gen.model.config.vocab_size
    if any(i >= vocab for i in ids):
        name = "byte-level text" if opts["tokenizer"] is None else f"tokenizer {opts['tokenizer']!r}"
        raise ValueError(f"{name} gives id {max(ids)} for the prompt, past the model's vocabulary ({vocab}): give "
                         "--tokenizer the tokenizer the model was trained with")
    return ids


def generate_prompts(gen, codec, opts: dict) -> list[dict] | None:
    """Every prompt in one batch; rank 0 prints (plain or JSON lines) and returns the records."""
    prompts = opts["prompts"]
    ids = [encode(gen, codec, p, opts) for p in prompts] if gen.is_chooser else [[0]] * len(prompts)  # broadcast
    outs = gen.generate(ids, opts["max_new_tokens"], opts["sampling"], stop_ids=_stop_ids(codec, opts),
                        stop_strings=opts["stop"], decode=codec.decode if codec else None, seed=opts["seed"])
    if not gen.is_chooser:
        return None
    records = [{"prompt": p, "completion": o.text, "prompt_tokens": len(o.prompt_ids), "new_tokens": len(o.ids),
                "finish_reason": o.finish_reason} for p, o in zip(prompts, outs)]
    for i, r in enumerate(records):
        if opts["json"]:
            print(json.dumps(r, ensure_ascii=False), flush=True)
            continue
        shown = r["prompt"] if isinstance(r["prompt"], str) else ""
        print(f"[{i + 1}/{len(records)}] {r['new_tokens']} new tokens ({r['finish_reason']})", flush=True)
        print(shown + r["completion"], flush=True)
    return records


def chat_loop(gen, codec, opts: dict, chat_input: str | None) -> None:
    """One user message a line (rank 0 reads stdin, or the pipe the launcher fills); the reply streamed."""
    from tpkernels.parallel import control  # noqa: PLC0415

    source = None
    if gen.is_chooser:
        source = open(chat_input) if chat_input else sys.stdin  # noqa: SIM115
    opening = [{"role": "system", "content": opts["system"]}] if opts["system"] else []
    messages = list(opening)
    while True:
        line = None
        if gen.is_chooser:
            print("you> ", end="", flush=True)
            line = source.readline()
            if line and not source.isatty():  # piped input: show what was said
                print(line.rstrip("\n"), flush=True)
            line = None if line == "" or line.strip() == "/exit" else line.rstrip("\n")
        line = control.broadcast_object(line, 0, gen.group)
        if line is None:
            if gen.is_chooser:
                print(flush=True)  # end the last "you> " line
            break
        if not line.strip():
            continue
        if line.strip() == "/reset":
            messages = list(opening)
            continue
        messages.append({"role": "user", "content": line})
        ids = [encode(gen, codec, messages, opts)] if gen.is_chooser else [[0]]
        reply: list[int] = []
        shown = [""]

        def stream(row, token):
            reply.append(token)
            text = codec.decode(reply).rstrip("\ufffd")  # an unfinished UTF-8 character waits for its bytes
            print(text[len(shown[0]):], end="", flush=True)
            shown[0] = text
        try:
            out = gen.generate(ids, opts["max_new_tokens"], opts["sampling"], stop_ids=_stop_ids(codec, opts),
                               stop_strings=opts["stop"], decode=codec.decode if codec else None, seed=opts["seed"],
                               stream=stream if gen.is_chooser else None)[0]
        except ValueError as e:  # the conversation outgrew the context: say so, start over
            if gen.is_chooser:
                print(f"\n{e}; starting a new conversation (/reset)", flush=True)
            messages = list(opening)
            continue
        if gen.is_chooser:
            print(f"\n[{len(out.ids)} tokens, {out.finish_reason}]", flush=True)
        messages.append({"role": "assistant", "content": out.text if out.text is not None else ""})
    if source is not None and source is not sys.stdin:
        source.close()


# ---- the command ----

def _pump(fifo: str) -> None:
    """The launcher's stdin, line by line, to rank 0's pipe (forked ranks get no terminal)."""
    with open(fifo, "w") as out:
        for line in sys.stdin:
            out.write(line)
            out.flush()


def run(args) -> int:
    opts = options(args)
    if args.nproc:
        from tpkernels.train.launch import launch  # noqa: PLC0415

        if not opts["chat"]:
            launch(rank_main, args.nproc, opts, None, quiet=not args.debug)
            return 0
        with tempfile.TemporaryDirectory(prefix="tpk_chat_") as tmp:
            fifo = os.path.join(tmp, "stdin")
            os.mkfifo(fifo)
            threading.Thread(target=_pump, args=(fifo,), daemon=True).start()
            launch(rank_main, args.nproc, opts, fifo, quiet=not args.debug)
        return 0
    if "RANK" in os.environ:  # torchrun: the world is the TP group
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        from tpkernels.train.failures import close_process_groups  # noqa: PLC0415

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        try:
            rank_main(opts)
        finally:
            close_process_groups()
        return 0
    rank_main(opts)
    return 0


def run_reporting_errors(args) -> int:
    """:func:`run` with bad input as one line naming it (exit 2) and a failed rank as one line (exit 1)."""
    from tpkernels.parallel.config import ParallelConfigError  # noqa: PLC0415
    from tpkernels.train.checkpoint_files import CheckpointError  # noqa: PLC0415
    from tpkernels.train.launch import LaunchError  # noqa: PLC0415

    if args.debug:
        return run(args)
    try:
        return run(args)
    except (ValueError, ParallelConfigError, CheckpointError, OSError) as e:
        print(f"tpkernels generate: error: {e}", file=sys.stderr)
        return 2
    except LaunchError as e:
        bad_input = e.kind in ("ValueError", "ParallelConfigError", "CheckpointError")
        print(f"tpkernels generate: error: {e.detail if bad_input else e}", file=sys.stderr)
        return 2 if bad_input else 1


__all__ = ["add_parser", "options", "rank_main", "read_prompts", "run", "run_reporting_errors"]
