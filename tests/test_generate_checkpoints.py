"""``tpkernels generate`` on training checkpoints of every finetune kind (full, LoRA, QLoRA with its NF4
base, FP8) without exporting them, at TP1 and TP2: the greedy tokens equal transformers' ``generate`` on
what ``export-hf`` writes of the same checkpoint. The command's input, output and named errors; an
interactive chat through a tokenizer's chat template."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch

from generate_checks import hf_greedy, random_prompts
from test_train import small

KINDS = {"full": {"training.precision": "fp64"},
         "lora": {"model.finetune": "lora", "model.lora_rank": 4, "training.precision": "fp64"},
         "qlora": {"model.finetune": "qlora", "model.lora_rank": 4, "training.precision": "fp64"},
         "fp8": {"training.precision": "fp8"}}  # bf16 weights, fp32 masters: generated in float64 here


@pytest.fixture(autouse=True)
def one_thread():
    """fp64 CPU attention spins with 2 OpenMP threads on a busy machine (see test_generate)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _train(tmp_path, seed: int) -> dict:
    """A 3-step run of each kind (byte-level vocabulary, random-documents), its checkpoint folder."""
    from tpkernels.train import Trainer

    out = {}
    for kind, kw in KINDS.items():
        ck = tmp_path / f"ck_{kind}"
        Trainer(small(**{"model.vocab": 257, "training.seed": seed, "steps": 3, "optimizer.lr": 0.05,
                         "checkpoint.save_dir": str(ck), **kw})).train()
        out[kind] = str(ck)
    return out


def _generate_worker(rank, world, folders, prompts, max_new, stops=None):
    from tpkernels.generate import Generator
    from tpkernels.parallel import ParallelConfig
    from tpkernels.parallel.state import ParallelState
    from tpkernels.train.generate_load import load_for_generation

    state = ParallelState.create(ParallelConfig(tp=world))
    out = {}
    for kind, folder in folders.items():
        loaded = load_for_generation(folder, state, dtype="float64")
        stop_ids = (stops or {}).get(kind) or ()
        out[kind] = [o.ids for o in Generator(loaded.model).generate(prompts, max_new, stop_ids=stop_ids)]
    return out


def test_every_finetune_kind_generates_as_its_export(rank_pool, tmp_path, fresh_seed, capsys):
    from tpkernels.cli import main
    from tpkernels.train.checkpoint import export_hf

    folders = _train(tmp_path, fresh_seed % 1000)
    prompts = random_prompts(fresh_seed, (6, 1, 10), vocab=257)
    want = {}
    stops = {}  # transformers stops where the export's generation_config says (the byte-level EOD, id 256)
    for kind, ck in folders.items():
        want[kind] = hf_greedy(str(export_hf(ck, tmp_path / f"hf_{kind}")), prompts, 7)
        eos = json.loads((tmp_path / f"hf_{kind}" / "generation_config.json").read_text()).get("eos_token_id")
        stops[kind] = [] if eos is None else eos if isinstance(eos, list) else [eos]
    assert want["lora"] != want["full"] or want["qlora"] != want["full"]  # the adapters change the model
    one = _generate_worker(0, 1, folders, prompts, 7, stops)
    tp2 = rank_pool(2).run(_generate_worker, folders, prompts, 7, stops, timeout=120)
    for kind in KINDS:
        assert one[kind] == want[kind], kind
        assert tp2[0][kind] == tp2[1][kind] == want[kind], kind
    # the command, in this process: JSON lines, the completion is the decoded greedy tokens
    capsys.readouterr()
    text = "".join(chr(c) for c in range(97, 104))
    assert main(["generate", folders["lora"], "--prompt", text, "--prompt", "x", "--max-new-tokens", "5",
                 "--json", "--dtype", "float64"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    from tpkernels.generate import TextCodec

    codec = TextCodec.load(None)
    again = _generate_worker(0, 1, {"lora": folders["lora"]}, [codec.encode(text), codec.encode("x")], 5)["lora"]
    assert [r["completion"] for r in lines] == [codec.decode(ids) for ids in again]
    assert [r["new_tokens"] for r in lines] == [len(ids) for ids in again] and lines[0]["prompt"] == text


def test_command_errors_are_named(tmp_path, capsys):
    from tpkernels.cli import main

    from data_checks import save_hf_llama

    folder = save_hf_llama(tmp_path / "m", 97)
    capsys.readouterr()
    cases = [
        ([str(tmp_path / "nowhere"), "--prompt", "a"], r"checkpoint \('.*nowhere'\) does not exist"),
        ([str(folder)], "give exactly one input: --prompt TEXT"),
        ([str(folder), "--prompt", "a", "--chat"], "give exactly one input"),
        ([str(folder), "--prompt", "a"], "holds no tokenizer .* give --tokenizer"),
        ([str(folder), "--prompt", "a", "--tokenizer", str(tmp_path / "tok")],
         r"--tokenizer \('.*tok'\) does not exist"),
        ([str(folder), "--chat", "--tokenizer", str(folder)], "is not a loadable Hugging Face tokenizer folder"),
        ([str(folder), "--prompt", "a", "--top-p", "0"], r"--top-p \(0.0\) must be in \(0, 1\]"),
        ([str(folder), "--prompt", "a", "--temperature", "-1"], r"--temperature \(-1.0\) must be a finite number >= 0"),
        ([str(folder), "--prompt", "a", "--max-new-tokens", "0"], r"--max-new-tokens \(0\) must be >= 1"),
        ([str(folder), "--prompt", "a", "--dtype", "int8"], r"--dtype \('int8'\) must be auto or one of"),
        ([str(folder), "--prompts", str(tmp_path / "p.jsonl")], r"--prompts \('.*p.jsonl'\) does not exist"),
        ([str(folder), "--prompt", "a", "--tokenizer", str(folder), "--nproc", "3"],
         r"--nproc \(3\) is the TP size of generation, which this model cannot take: num_attention_heads \(4\) must "
         r"be divisible by tp \(3\)"),
    ]
    for argv, msg in cases:
        assert main(["generate", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("tpkernels generate: error: ") and re.search(msg, err), (argv, err)
    (tmp_path / "p.jsonl").write_text('"fine"\n{"prompt": 3}\n')
    assert main(["generate", str(folder), "--prompts", str(tmp_path / "p.jsonl")]) == 2
    assert "p.jsonl:2: a line must be a non-empty string" in capsys.readouterr().err


def test_chat_applies_the_template_turn_by_turn(tmp_path, fresh_seed, monkeypatch, capsys):
    """--chat: each turn renders the whole conversation (with the replies so far) through the tokenizer's chat
    template and generates greedily; /reset starts over. The first reply equals transformers' greedy
    continuation of the rendered conversation; a tokenizer without a template is refused by name."""
    import transformers

    from data_checks import make_tokenizer
    from generate_checks import save_varied_model
    from tpkernels.cli import main

    tok_dir = make_tokenizer(tmp_path / "tok")
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    folder = tmp_path / "m"
    save_varied_model("llama", folder, fresh_seed % 1000, layers=2)
    cfg = json.loads((folder / "config.json").read_text())
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float64)
    model.resize_token_embeddings(len(tok))  # the tokenizer's vocabulary
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    assert cfg["vocab_size"] != len(tok)
    first = [{"role": "user", "content": "hello how are you"}]
    ids = tok.apply_chat_template(first, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    want = hf_greedy(str(folder), [ids], 4, eos_token_id=tok.eos_token_id)[0]
    monkeypatch.setattr("sys.stdin", io.StringIO("hello how are you\n/reset\nwhat is two plus three\n"))
    capsys.readouterr()
    assert main(["generate", str(folder), "--chat", "--max-new-tokens", "4", "--dtype", "float64"]) == 0
    out = capsys.readouterr().out
    turns = out.split("you> ")[1:]
    assert len(turns) == 4  # two replies, the /reset line, the end of input
    said, reply = turns[0].split("\n", 1)  # piped input is echoed, then the streamed reply
    assert said == "hello how are you"
    reply = reply.rsplit("\n[", 1)[0]
    assert reply == tok.decode(want, skip_special_tokens=True)
    assert turns[0].rstrip().endswith(f"[{len(want)} tokens, {'stop' if want[-1] == tok.eos_token_id else 'length'}]")
    # the model folder's generation_config.json eos_token_id stops a reply too (Llama 3 lists end-of-turn ids there)
    argv = ["generate", str(folder), "--prompt", "hello how are you", "--max-new-tokens", "6", "--json",
            "--dtype", "float64"]
    assert main(argv) == 0
    free = json.loads(capsys.readouterr().out)
    ids = tok("hello how are you")["input_ids"]
    reply = hf_greedy(str(folder), [ids], 6)[0]
    assert free["new_tokens"] == len(reply) or tok.eos_token_id in reply
    if tok.eos_token_id not in reply[:2]:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [reply[1], 10 ** 6]}))
        assert main(argv) == 0
        stopped = json.loads(capsys.readouterr().out)
        assert stopped["new_tokens"] == reply.index(reply[1]) + 1 and stopped["finish_reason"] == "stop"
    no_template = make_tokenizer(tmp_path / "plain", template=None)
    assert main(["generate", str(folder), "--chat", "--tokenizer", str(no_template)]) == 2
    assert "--chat needs a tokenizer with a chat template" in capsys.readouterr().err


def _train_worker(rank, world, keys):
    from tpkernels.train import Trainer

    Trainer(small(**keys)).train()
    return rank


def test_eval_samples_write_what_the_checkpoint_generates(rank_pool, tmp_path, fresh_seed):
    """eval.samples: the greedy continuations written at the last validation are what tpkernels generate
    gives from the checkpoint saved at that step (a separate path: the checkpoint reloaded). Layouts the
    generator cannot run, a missing file and samples without validations are refused by name."""
    from tpkernels.generate import Generator, TextCodec
    from tpkernels.train import Trainer
    from tpkernels.train.generate_load import load_for_generation

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"hello"\n{"prompt": "abc def"}\n\n"x"\n')
    metrics = tmp_path / "m.jsonl"
    keys = {"model.vocab": 257, "steps": 3, "eval.every": 3, "eval.source": "random-documents",
            "eval.samples": str(prompts), "eval.sample_tokens": 5, "training.precision": "fp64",
            "training.seed": fresh_seed % 1000}
    Trainer(small(**keys, **{"logging.metrics_file": str(metrics),
                             "checkpoint.save_dir": str(tmp_path / "ck")})).train()
    records = [json.loads(line) for line in metrics.read_text().splitlines() if "eval/samples" in line]
    assert [r["step"] for r in records] == [2]
    codec = TextCodec.load(None)
    model = load_for_generation(tmp_path / "ck", None, dtype="float64").model
    texts = ["hello", "abc def", "x"]
    outs = Generator(model).generate([codec.encode(t) for t in texts], 5, stop_ids=codec.stop_ids, decode=codec.decode)
    assert records[0]["eval/samples"] == [{"prompt": t, "completion": o.text} for t, o in zip(texts, outs)]
    # at TP2 (the trainer's own layout, every rank generating, TP rank 0 choosing): what its checkpoint gives
    tp2 = {**keys, "parallel.tp": 2, "logging.metrics_file": str(tmp_path / "m2.jsonl"),
           "checkpoint.save_dir": str(tmp_path / "ck2")}
    assert rank_pool(2).run(_train_worker, tp2, timeout=120) == [0, 1]
    records = [json.loads(line) for line in (tmp_path / "m2.jsonl").read_text().splitlines() if "eval/samples" in line]
    model = load_for_generation(tmp_path / "ck2", None, dtype="float64").model
    outs = Generator(model).generate([codec.encode(t) for t in texts], 5, stop_ids=codec.stop_ids, decode=codec.decode)
    assert records[0]["eval/samples"] == [{"prompt": t, "completion": o.text} for t, o in zip(texts, outs)]
    for extra, msg in (({"parallel.tp": 2, "parallel.sequence_parallel": True}, r"parallel.sequence_parallel \(True\)"),
                       ({"parallel.pp": 2}, r"needs parallel.pp 1.*now parallel.pp \(2\)"),
                       ({"eval.samples": str(tmp_path / "none.jsonl")},
                        r"eval.samples \('.*none.jsonl'\) must be a JSONL"),
                       ({"eval.every": 0, "eval.source": None}, r"eval.samples \('.*'\) needs eval.every"),
                       ({"eval.sample_tokens": 0}, r"eval.sample_tokens \(0\) must be >= 1")):
        with pytest.raises(ValueError, match=msg):
            small(**{**keys, **extra}).check()


def test_a_hugging_face_gpt2_folder_with_dropout_generates_as_transformers(tmp_path, fresh_seed):
    """A GPT-2 config as transformers writes it (dropout 0.1 everywhere) loads for generation (dropout is off
    at inference) and gives transformers' greedy tokens."""
    import transformers

    from tpkernels.generate import Generator
    from tpkernels.train.generate_load import load_for_generation

    cfg = transformers.GPT2Config(vocab_size=89, n_embd=24, n_layer=2, n_head=3, n_positions=40)
    assert cfg.resid_pdrop > 0 and cfg.attn_pdrop > 0
    torch.manual_seed(fresh_seed % 1000)
    model = transformers.GPT2LMHeadModel(cfg).double()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(str(tmp_path / "gpt2"))
    prompts = random_prompts(fresh_seed, (5, 2), vocab=89)
    loaded = load_for_generation(tmp_path / "gpt2", None, dtype="float64")
    assert loaded.kind == "hf" and loaded.tokenizer is None
    outs = Generator(loaded.model).generate(prompts, 6)
    assert [o.ids for o in outs] == hf_greedy(str(tmp_path / "gpt2"), prompts, 6)
