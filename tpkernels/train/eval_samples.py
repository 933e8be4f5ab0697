"""``eval.samples``: at each validation, a few prompts continued greedily by the model being trained, written
to the metrics file (and so to TensorBoard's text tab, as a table) so that a fine-tuning run shows what
the model says, not only its loss.

    eval.samples: prompts.jsonl          # as `tpkernels generate --prompts` reads: a string, {"prompt": ...}
    eval.sample_tokens: 24               #   or {"messages": [...]} (through data.tokenizer's chat template)

The record: {"step": s, "eval/samples": [{"prompt": ..., "completion": ...}, ...]}. Generation runs at the
run's own layout (every TP group generates; TP rank 0 chooses each token: tpkernels.generate), so it
needs what the generator needs: one pipeline stage, no context parallelism, sequence parallelism off
(a decoding step's one token per row cannot be split along the sequence); the config check
(TrainConfig.errors) refuses the rest by name.
"""

from __future__ import annotations

from tpkernels.generate import Generator, TextCodec
from tpkernels.generate.text import read_prompts


class EvalSamples:
    """The prompts of ``eval.samples``, encoded once with ``data.tokenizer``; :meth:`record` generates."""

    def __init__(self, cfg, model):
        ev = cfg.eval
        self.prompts = read_prompts(ev.samples, "eval.samples")
        self.codec = TextCodec.load(cfg.data.tokenizer, "data.tokenizer")
        self.tokens = ev.sample_tokens
        self.ids = [self.codec.chat(p) if isinstance(p, list) else self.codec.encode(p) for p in self.prompts]
        vocab = model.config.vocab_size
        for p, ids in zip(self.prompts, self.ids):
            if len(ids) >= model.config.max_position_embeddings:
                raise ValueError(f"eval.samples: the prompt {p!r} has {len(ids)} tokens: the model's context "
                                 f"(max_position_embeddings) is {model.config.max_position_embeddings}; shorten it")
            if not ids or max(ids) >= vocab:
                raise ValueError(f"eval.samples: the prompt {p!r} encodes to {len(ids)} ids "
                                 f"{'(none)' if not ids else 'up to ' + str(max(ids))}: each needs at least one id "
                                 f"below the model's vocabulary ({vocab})")
        try:
            self.generator = Generator(model)
        except ValueError as e:  # a layout chosen by layout auto after the config check
            raise ValueError(f"eval.samples cannot run at this run's layout: {e}; leave eval.samples unset, or sample "
                             "from the checkpoints with tpkernels generate (any TP layout)") from None

    def record(self, step: int) -> dict:
        """The greedy continuations (collective over the TP group), as a metrics record."""
        outs = self.generator.generate(self.ids, self.tokens, stop_ids=self.codec.stop_ids,
                                       decode=self.codec.decode)
        rows = [{"prompt": p if isinstance(p, str) else p[-1]["content"], "completion": o.text}
                for p, o in zip(self.prompts, outs)]
        return {"step": step, "eval/samples": rows}


__all__ = ["EvalSamples"]
