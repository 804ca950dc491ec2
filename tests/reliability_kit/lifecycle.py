"""Lifecycle fuzzing: generated sequences of operations on models (the tiny decoder, a BERT
reranker and a T5), contexts, samplers, batches, LoRA adapters, Llama objects (one slot and
parallel slots; with speculative decoding, a vision projector or a prompt cache on disk;
completions, streams and ``evaluate`` calls; image prompts the projector evaluates at any
position and sequence) and their streams.

A program is a list of operations (JSON), drawn with hypothesis in the parent: create, use,
cancel, close, drop (forget the reference), ``gc.collect``, run an operation on another thread
(joined at once or left running), close while another thread decodes, use a Llama from inside
a generation (a custom sampler's callback: close, complete, reset, ...), fork the process (the
child must refuse every object it inherited, load a model of its own and leave, by
``os._exit`` or through the exit hooks), and leave the interpreter while a thread decodes or a
stream is open (``"exit"`` programs, one per child).
Operations name their objects by small indices, resolved modulo the live objects of that kind
when they run, so every program means something whatever failed before it.

Run in a child: every operation's LlamaError is counted as a refusal; any other exception is
an unclean error; a thread that does not finish is a hang. At the end of a program the threads
are joined and every object is closed or dropped (the program says which, and in what order),
then collected.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import math
import os
import random
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from reliability_kit.programs import THREAD_JOIN_SECONDS, Program, stacks

KINDS = ("model", "context", "sampler", "batch", "adapter", "llama", "stream")
TINY_VOCAB = 271  # scripts/make_tiny_gguf.py: 3 control, 256 bytes, 12 word pieces
ENCODER_VOCAB = 24  # scripts/convert_bert.py's reranker: 5 special tokens, 19 words
EXIT_EVERY = 40  # one program in 40 ends by leaving the interpreter mid-decode


def _model_prelude(kind: str, n_seq: int, **context: Any) -> list[dict[str, Any]]:
    """Operations that load a model of ``kind``, make a context of it and a batch of 32."""
    return [{"op": "model", "vocab_only": False, "mmap": True, "kind": kind},
            {"op": "context", "m": 0, "n_seq": n_seq, "flash": "auto", "type_k": "f16",
             **context},
            {"op": "batch", "capacity": 32, "n_seq": n_seq}]  # fmt: skip


ENCODER_SETUP = _model_prelude("encoder", 2, n_ctx=256, n_batch=256, n_ubatch=256, emb=True,
                               pooling="rank", unified=False)  # fmt: skip
# A T5 context runs one sequence (llama.cpp keeps one encoder output per context).
T5_SETUP = _model_prelude("t5", 1, n_ctx=64, n_batch=32, n_ubatch=32, emb=False,
                          pooling="unspecified", unified=True)  # fmt: skip
# The decoder's first token (the start token, 0) at position 0 of sequence 0.
T5_START = [
    {"op": "fill", "b": 0, "how": "one", "tokens": [0], "pos": 0, "seq": 0, "logits_all": False},
    {"op": "decode", "c": 0, "b": 0},
]
FORKED_CHILD_SECONDS = 30.0
# What a custom sampler does, from inside a generation, to a Llama (its own or another).
REENTRY_ACTIONS = ("close", "close_context", "close_model", "complete", "stream", "reset",
                   "save_state", "tokenize", "set_lora", "cancel", "evaluate")  # fmt: skip
GRAMMARS = (
    None,
    'root ::= "the" | "a" " cat"',
    "root ::= [a-z ]+",
    'root ::= item+\nitem ::= "x" | "y" item',
    "root ::= (",  # invalid: llama.cpp refuses it
    'root ::= "a"{2,5} [^\\x00-\\x1f]*',
)
PROMPTS: tuple[Any, ...] = (
    "the cat",
    "the cat sat on the mat " * 12,
    "",
    "a\0b",
    "<s></s> é 漢字 🙂",
    [1, 5, 30],
    [1, 270],
    [TINY_VOCAB],
    [-1],
    [],
)
# What a Llama may have beside the model: speculative decoding (prompt lookup, or a draft model:
# the tiny model again), a vision projector, a prompt cache on disk.
LLAMA_EXTRAS = ("plain",) * 5 + ("lookup", "draft", "vision", "disk_cache")
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


# -- generation (parent) -----------------------------------------------------------------------


def strategies() -> Any:
    """The hypothesis strategy of one program."""
    from hypothesis import strategies as st

    idx = st.integers(0, 3)
    token = st.one_of(
        st.integers(0, ENCODER_VOCAB - 1),
        st.integers(0, TINY_VOCAB - 1),
        st.sampled_from([-1, TINY_VOCAB, 2**31 - 1]),
    )
    tokens = st.lists(token, max_size=40)
    position = st.sampled_from([0, 0, 1, 5, 60, 1000, 100_000, -1, -5, 2**31 - 1])
    seq = st.sampled_from([0, 0, 1, 2, 3, -1, 5, 1000, 2**20])
    index = st.sampled_from([-1, -1, 0, 1, 3, 100, -100])
    scale = st.sampled_from([1.0, 0.5, 0.0, -1.0, 1e30, math.nan])
    text = st.one_of(st.sampled_from(["the cat", "", "\0", "<s>", "é🙂"]), st.text(max_size=30))

    def op(name: str, **fields: Any) -> tuple[str, Any]:
        return name, st.fixed_dictionaries({"op": st.just(name), **fields})

    base = [
        (2, op("model", vocab_only=st.sampled_from([False, False, False, True]),
               mmap=st.booleans(), kind=st.sampled_from(["decoder"] * 4 + ["encoder", "t5"]))),
        (3, op("context", m=idx, n_ctx=st.sampled_from([8, 32, 64, 256]),
               n_batch=st.sampled_from([1, 8, 32, 512]), n_ubatch=st.sampled_from([1, 8, 512]),
               n_seq=st.sampled_from([1, 1, 2, 4]), emb=st.sampled_from([False, False, True]),
               pooling=st.sampled_from(["unspecified", "none", "mean", "last", "rank"]),
               flash=st.sampled_from(["auto", "on", "off"]),
               type_k=st.sampled_from(["f16", "f16", "q8_0", "f32"]),
               unified=st.booleans())),
        (3, op("sampler", m=idx, temperature=st.sampled_from([0.0, 0.8, 5.0, -1.0, math.nan]),
               top_k=st.sampled_from([40, 0, 1]), grammar=st.sampled_from(GRAMMARS),
               bias=st.dictionaries(st.integers(0, TINY_VOCAB - 1),
                                    st.sampled_from([1.0, -math.inf, math.inf, math.nan]),
                                    max_size=3),
               mirostat=st.sampled_from([0, 0, 1, 2]), penalty=st.sampled_from([1.0, 1.5]),
               dry=st.sampled_from([0.0, 0.8]), xtc=st.sampled_from([0.0, 0.5]),
               seed=st.sampled_from([None, 0, 2**32 - 1]))),
        (2, op("batch", capacity=st.sampled_from([0, 1, 4, 32, 300]),
               n_seq=st.sampled_from([1, 2, 4, 0]))),
        (4, op("fill", b=idx, how=st.sampled_from(["set", "set", "one", "rows", "sequences"]),
               tokens=tokens, pos=position, seq=seq, logits_all=st.booleans())),
        (5, op("decode", c=idx, b=idx)),
        (2, op("encode", c=idx, b=idx)),
        (2, op("logits", c=idx, index=index)),
        (2, op("embeddings", c=idx, width=st.sampled_from([64, 64, 1, 65, 10**7, 0]),
               seq=st.sampled_from([None, None, 0, 1]), index=index,
               count=st.sampled_from([1, 2, 3, 1000, 0]))),
        (3, op("sample", s=idx, c=idx, index=index)),
        (2, op("accept", s=idx, token=token)),
        (1, op("reset_sampler", s=idx)),
        (3, op("kv", c=idx, action=st.sampled_from(
            ["clear", "remove", "copy", "keep", "shift", "divide", "positions"]),
            seq=seq, dst=seq, p0=st.sampled_from([0, 1, 5, -1]),
            p1=st.sampled_from([-1, 0, 3, 100]), delta=st.sampled_from([-5, 0, 3, 1000, -(2**31)]),
            divisor=st.sampled_from([0, 1, 2, 3]))),
        (2, op("state", c=idx, seq=st.sampled_from([None, 0, 1, 5]),
               corrupt=st.sampled_from(["none", "truncate", "flip", "empty", "double"]))),
        (2, op("vocab", m=idx, action=st.sampled_from(["tokenize", "detokenize", "piece"]),
               text=text, tokens=tokens, special=st.booleans())),
        (2, op("adapter", m=idx)),
        (2, op("set_adapters", c=idx, adapters=st.lists(st.tuples(idx, scale), max_size=3))),
        (3, op("llama", parallel=st.sampled_from([None, None, 2, 3]),
               n_ctx=st.sampled_from([64, 128, 512]), n_batch=st.sampled_from([8, 32, 512]),
               lora=st.sampled_from([False, False, True]), cache=st.booleans(),
               extra=st.sampled_from(LLAMA_EXTRAS))),
        (6, op("complete", l=idx, prompt=st.sampled_from(PROMPTS), image=st.booleans(),
               max_tokens=st.sampled_from([0, 1, 4, 16, 64]),
               temperature=st.sampled_from([0.0, 0.8]), n=st.sampled_from([1, 1, 2]),
               grammar=st.sampled_from(GRAMMARS), stop=st.sampled_from([(), ("a",), ("",)]),
               logprobs=st.sampled_from([None, 0, 2]), min_tokens=st.sampled_from([0, 4]),
               echo=st.booleans(), timeout=st.sampled_from([None, None, 0.001, 5.0]))),
        (2, op("chat", l=idx, format=st.sampled_from(["chatml", "llama3", "alpaca", TEMPLATE]),
               content=text, max_tokens=st.sampled_from([1, 4]),
               json=st.sampled_from([False, False, True]))),
        (4, op("stream", l=idx, prompt=st.sampled_from(PROMPTS),
               max_tokens=st.sampled_from([1, 8, 64, 400]), min_tokens=st.sampled_from([0, 8]))),
        (6, op("next", t=idx, k=st.sampled_from([1, 2, 5, 50]))),
        (2, op("stream_close", t=idx)),
        (2, op("stream_cancel", t=idx)),
        (2, op("cancel", l=idx)),
        (2, op("llama_lora", l=idx, scale=scale)),
        (1, op("llama_set_lora", l=idx, adapters=st.lists(st.tuples(idx, scale), max_size=2))),
        (2, op("llama_state", l=idx, action=st.sampled_from(["save", "save_context", "load",
                                                              "load_corrupt", "reset"]))),
        (1, op("embed", l=idx)),
        (2, op("project", l=idx, pos=position, seq=seq)),
        (3, op("evaluate", l=idx, tokens=st.sampled_from(PROMPTS[5:]) | tokens,
               all_logits=st.booleans(), after=st.sampled_from([None, None, 0, 2, 1000, -1]),
               slot=st.sampled_from([None, None, 0, 1, 5, -1]))),
        (5, op("close", kind=st.sampled_from(KINDS), i=idx)),
        (4, op("drop", kind=st.sampled_from(KINDS), i=idx)),
        (2, op("gc")),
        (3, op("close_during", l=idx, what=st.sampled_from(["llama", "context", "model"]),
               work=st.sampled_from(["complete", "complete", "tokenize", "detokenize",
                                     "context", "sampler", "adapter", "metadata", "embed",
                                     "image", "evaluate"]),
               delay=st.sampled_from([0.0, 0.001, 0.01]))),
        (1, op("sleep", seconds=st.sampled_from([0.0, 0.001, 0.01]))),
        (1, op("fork", leave=st.sampled_from(["os_exit", "exit_hooks"]))),
        (2, op("reenter", l=idx, target=idx, action=st.sampled_from(REENTRY_ACTIONS),
               at=st.sampled_from([0, 1, 3]))),
    ]  # fmt: skip
    # One draw picks the operation by weight; one_of would not keep the weights.
    names = [name for weight, (name, _) in base for _ in range(weight)]
    by_name = dict(s for _, s in base)
    plain = st.sampled_from(names).flatmap(lambda name: by_name[name])
    threaded = st.fixed_dictionaries(
        {"op": st.just("thread"), "inner": plain, "join": st.booleans()}
    )
    any_op = st.sampled_from(["plain"] * 17 + ["thread", "thread", "join"]).flatmap(
        lambda kind: (
            threaded if kind == "thread" else st.just({"op": "join"}) if kind == "join" else plain
        )
    )

    # A raw batch of valid tokens decoded at once into a BERT reranker: a learned position
    # table of 64 rows (a position outside it reads outside the table), no KV cache.
    def first_fill(vocab: int, seq: Any) -> Any:
        """Batch 0 filled with 1 to 8 valid tokens at a drawn position."""
        return op("fill", b=st.just(0), how=st.sampled_from(["set", "one", "rows"]),
                  tokens=st.lists(st.integers(0, vocab - 1), min_size=1, max_size=8),
                  pos=position, seq=seq, logits_all=st.booleans())[1]  # fmt: skip

    encoder_fill = first_fill(ENCODER_VOCAB, st.sampled_from([0, 1]))
    encoder_prelude = encoder_fill.map(
        lambda fill: [*ENCODER_SETUP, fill, {"op": "decode", "c": 0, "b": 0}]
    )
    # An encoder-decoder model (T5): its input encoded, then the decoder's first token.
    t5_prelude = first_fill(TINY_VOCAB, st.just(0)).map(
        lambda fill: [*T5_SETUP, fill, {"op": "encode", "c": 0, "b": 0}, *T5_START]
    )
    llama_prelude = [{"op": "llama", "parallel": None, "n_ctx": 128, "n_batch": 32,
                      "lora": False, "cache": False, "extra": "plain"}]  # fmt: skip
    preludes = st.sampled_from(
        [
            [],
            llama_prelude,
            [{**llama_prelude[0], "parallel": 2}],
            [{**llama_prelude[0], "n_ctx": 512, "extra": "vision"}],
            [{**llama_prelude[0], "n_ctx": 512, "extra": "draft"}],
            [{"op": "model", "vocab_only": False, "mmap": True, "kind": "decoder"},
             {"op": "context", "m": 0, "n_ctx": 64, "n_batch": 32, "n_ubatch": 32, "n_seq": 2,
              "emb": False, "pooling": "unspecified", "flash": "auto", "type_k": "f16",
              "unified": False},
             {"op": "batch", "capacity": 32, "n_seq": 2},
             {"op": "sampler", "m": 0, "temperature": 0.0, "top_k": 40, "grammar": None,
              "bias": {}, "mirostat": 0, "penalty": 1.0, "dry": 0.0, "xtc": 0.0, "seed": 0}],
            "encoder",
            "t5",
        ]
    )  # fmt: skip
    drawn = {"encoder": encoder_prelude, "t5": t5_prelude}
    preludes = preludes.flatmap(lambda p: drawn[p] if isinstance(p, str) else st.just(p))
    exit_modes = [
        "decoding_daemon",
        "decoding_thread",
        "open_stream",
        "parallel_streams",
        "closing",
        "encoding_image",
        "drafting",
    ]
    exit_op = op("exit", mode=st.sampled_from(exit_modes))[1]

    @st.composite
    def program(draw: Any) -> dict[str, Any]:
        ops = list(draw(preludes)) + draw(st.lists(any_op, min_size=4, max_size=24))
        teardown = draw(st.sampled_from(["close", "drop", "close_reversed"]))
        return {"ops": ops, "teardown": teardown, "exit_op": draw(exit_op)}

    return program()


def generate(count: int, seed: int) -> list[dict[str, Any]]:
    """``count`` programs drawn with hypothesis from ``seed`` (the same list every time)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    programs: list[dict[str, Any]] = []

    @hypothesis_seed(seed)
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(strategies())
    def collect(program: dict[str, Any]) -> None:
        programs.append(program)

    collect()
    # hypothesis may stop a little short of max_examples; top up from a plain Random.
    rng = random.Random(seed)
    while programs and len(programs) < count:
        programs.append(programs[rng.randrange(len(programs))])
    cases = []
    for i, program in enumerate(programs[:count]):
        # One in EXIT_EVERY leaves the interpreter with work in flight (a child of its own).
        exit_op = program.pop("exit_op")
        ends_in_exit = i % EXIT_EVERY == EXIT_EVERY - 1
        if ends_in_exit:
            program["ops"] = [*program["ops"], exit_op]
        cases.append({"id": f"lifecycle-{seed}-{i}", "exit": ends_in_exit, **program})
    return cases


# -- execution (child) -------------------------------------------------------------------------


def setup(config: dict[str, Any], slot: int) -> dict[str, Any]:
    return {key: Path(config[key]) for key in ("model", "lora", "vision", "encoder", "t5")}


_EXITING: list[Machine] = []  # an "exit" program's objects, alive while the interpreter leaves


def run_case(case: dict[str, Any], state: dict[str, Any]) -> tuple[str, str]:
    machine = Machine(state)
    baseline = {t.ident for t in threading.enumerate()}
    for op in case["ops"]:
        machine.run(op)
    if case.get("exit"):
        _EXITING.append(machine)
        return machine.outcome()
    stuck = machine.join_threads()
    if stuck:
        return "hang", f"threads never finished: {machine.summary()}\n{stacks(stuck)}"
    machine.teardown(case["teardown"])
    leftover = _wait_for_threads(baseline)
    if leftover:
        return "hang", f"threads still running after teardown: {leftover}; {machine.summary()}"
    return machine.outcome()


def _image(side: int = 8) -> Any:
    """A small grey image (the tiny projector encodes it in milliseconds)."""
    from llamacrab import Image

    return Image(pixels=np.full((side, side, 3), 128, np.uint8))


def _reentry(llm: Any, action: str) -> None:
    slot = 0 if llm.scheduler is not None else None
    if action == "close":
        llm.close()
    elif action in ("close_context", "close_model"):
        (llm.context if action == "close_context" else llm.model).close()
    elif action == "complete":
        llm.create_completion("the dog", max_tokens=2)
    elif action == "stream":
        next(iter(llm.stream_completion("the dog", max_tokens=2)), None)
    elif action == "reset":
        llm.reset(slot=slot)
    elif action == "save_state":
        llm.save_state(slot=slot)
    elif action == "tokenize":
        llm.tokenize("the dog")
    elif action == "set_lora":
        llm.set_lora_adapters({})
    elif action == "evaluate":
        llm.evaluate([5, 30], slot=slot)
    else:
        llm.cancel()


def _wait_for_threads(baseline: set[int | None], seconds: float = 10.0) -> list[str]:
    deadline = time.monotonic() + seconds
    while True:
        extra = [t for t in threading.enumerate() if t.ident not in baseline and t.is_alive()]
        if not extra or time.monotonic() > deadline:
            return [t.name for t in extra]
        gc.collect()
        time.sleep(0.01)


class Machine(Program):
    """The objects of one program and the interpreter of its operations."""

    def __init__(self, paths: dict[str, Path]) -> None:
        super().__init__()
        self.model_path, self.lora_path = paths["model"], paths["lora"]
        self.vision_path = paths["vision"]
        # What a model operation loads: the tiny decoder, a BERT reranker (learned positions,
        # no KV cache) or a T5 (an encoder, then a decoder attending to its output).
        self.kinds = {"decoder": paths["model"], "encoder": paths["encoder"], "t5": paths["t5"]}
        self.objects: dict[str, list[Any]] = {kind: [] for kind in KINDS}
        self.states: list[Any] = []
        self.disk_caches: list[tempfile.TemporaryDirectory[str]] = []

    # -- bookkeeping ---------------------------------------------------------------------------

    def get(self, kind: str, i: int) -> Any:
        live = [o for o in self.objects[kind] if o is not None]
        return live[i % len(live)] if live else None

    def add(self, kind: str, obj: Any) -> Any:
        with self.lock:
            self.objects[kind].append(obj)
        return obj

    def teardown(self, how: str) -> None:
        order = [o for kind in KINDS for o in self.objects[kind] if o is not None]
        if how == "close_reversed":
            order.reverse()
        if how.startswith("close"):
            for obj in order:
                if hasattr(obj, "close"):  # a Batch is plain memory Python owns
                    self.run({"op": "_close_object", "obj": obj})
        for kind in KINDS:
            self.objects[kind].clear()
        self.states.clear()
        del order
        gc.collect()
        for folder in self.disk_caches:
            folder.cleanup()

    # -- operations ----------------------------------------------------------------------------

    def op__close_object(self, op: dict[str, Any]) -> None:
        op["obj"].close()

    def op_model(self, op: dict[str, Any]) -> None:
        from llamacrab import Model, ModelParams

        params = ModelParams(vocab_only=op["vocab_only"], use_mmap=op["mmap"])
        self.add("model", Model.load(self.kinds[op["kind"]], params))

    def op_context(self, op: dict[str, Any]) -> None:
        from llamacrab import Context, ContextParams

        model = self.get("model", op["m"])
        if model is None:
            return
        params = ContextParams(n_ctx=op["n_ctx"], n_batch=op["n_batch"], n_ubatch=op["n_ubatch"],
                               n_seq_max=op["n_seq"], n_threads=1, embeddings=op["emb"],
                               pooling=op["pooling"], flash_attn=op["flash"],
                               type_k=op["type_k"], kv_unified=op["unified"])  # fmt: skip
        self.add("context", Context(model, params))

    def op_sampler(self, op: dict[str, Any]) -> None:
        from llamacrab import SamplerChain, SamplingOptions

        model = self.get("model", op["m"])
        if model is None:
            return
        options = SamplingOptions(
            temperature=op["temperature"], top_k=op["top_k"], grammar=op["grammar"],
            logit_bias={int(k): v for k, v in op["bias"].items()}, mirostat=op["mirostat"],
            repeat_penalty=op["penalty"], dry_multiplier=op["dry"], xtc_probability=op["xtc"],
            seed=op["seed"],
        )  # fmt: skip
        self.add("sampler", SamplerChain(model, options))

    def op_batch(self, op: dict[str, Any]) -> None:
        from llamacrab import Batch

        self.add("batch", Batch(op["capacity"], op["n_seq"]))

    def op_fill(self, op: dict[str, Any]) -> None:
        import numpy as np

        batch = self.get("batch", op["b"])
        if batch is None:
            return
        tokens = np.array(op["tokens"], dtype=np.int64).astype(np.int32)
        how, n = op["how"], len(tokens)
        if how == "set":
            batch.set(tokens, op["pos"], op["seq"], logits_all=op["logits_all"])
        elif how == "one":
            batch.set_one(int(tokens[0]) if n else 1, op["pos"], op["seq"])
        elif how == "rows":
            positions = np.arange(op["pos"], op["pos"] + n, dtype=np.int64).astype(np.int32)
            seq_ids = np.array([(op["seq"] + i) % 3 for i in range(n)], dtype=np.int32)
            batch.set_rows(tokens, positions, seq_ids, np.ones(n, dtype=np.int8))
        else:
            half = n // 2
            batch.set_sequences([tokens[:half], tokens[half:]])

    def op_decode(self, op: dict[str, Any]) -> None:
        context, batch = self.get("context", op["c"]), self.get("batch", op["b"])
        if context is not None and batch is not None:
            context.decode(batch)

    def op_encode(self, op: dict[str, Any]) -> None:
        context, batch = self.get("context", op["c"]), self.get("batch", op["b"])
        if context is not None and batch is not None:
            context.encode(batch)

    def op_logits(self, op: dict[str, Any]) -> None:
        context = self.get("context", op["c"])
        if context is not None:
            context.logits(op["index"])

    def op_embeddings(self, op: dict[str, Any]) -> None:
        context = self.get("context", op["c"])
        if context is not None:
            context.embeddings(op["width"], seq_id=op["seq"], index=op["index"], count=op["count"])

    def op_sample(self, op: dict[str, Any]) -> None:
        sampler, context = self.get("sampler", op["s"]), self.get("context", op["c"])
        if sampler is not None and context is not None:
            sampler.sample(context, op["index"])

    def op_accept(self, op: dict[str, Any]) -> None:
        sampler = self.get("sampler", op["s"])
        if sampler is not None:
            sampler.accept(op["token"])

    def op_reset_sampler(self, op: dict[str, Any]) -> None:
        sampler = self.get("sampler", op["s"])
        if sampler is not None:
            sampler.reset()

    def op_kv(self, op: dict[str, Any]) -> None:
        context = self.get("context", op["c"])
        if context is None:
            return
        action, seq = op["action"], op["seq"]
        if action == "clear":
            context.clear()
        elif action == "remove":
            context.remove(seq, op["p0"], op["p1"])
        elif action == "copy":
            context.copy(seq, op["dst"], op["p0"], op["p1"])
        elif action == "keep":
            context.keep(seq)
        elif action == "shift":
            context.shift(seq, op["delta"], op["p0"], op["p1"])
        elif action == "divide":
            context.divide(seq, op["divisor"], op["p0"], op["p1"])
        else:
            context.positions(seq)

    def op_state(self, op: dict[str, Any]) -> None:
        context = self.get("context", op["c"])
        if context is None:
            return
        data = bytearray(context.state_bytes(op["seq"]))
        corrupt = op["corrupt"]
        if corrupt == "truncate":
            data = data[: len(data) // 2]
        elif corrupt == "flip" and data:
            for i in range(0, len(data), max(1, len(data) // 7)):
                data[i] ^= 0xFF
        elif corrupt == "empty":
            data = bytearray()
        elif corrupt == "double":
            data = data + data
        context.load_state_bytes(bytes(data), op["seq"])

    def op_vocab(self, op: dict[str, Any]) -> None:
        model = self.get("model", op["m"])
        if model is None:
            return
        vocab = model.vocab
        if op["action"] == "tokenize":
            vocab.tokenize(op["text"], add_special=op["special"], parse_special=op["special"])
        elif op["action"] == "detokenize":
            vocab.detokenize(op["tokens"], special=op["special"])
        else:
            for token in op["tokens"][:5]:
                vocab.token_to_piece(token, special=op["special"])
                vocab.token_to_bytes(token, special=op["special"])

    def op_adapter(self, op: dict[str, Any]) -> None:
        from llamacrab import LoraAdapter

        model = self.get("model", op["m"])
        if model is not None:
            self.add("adapter", LoraAdapter(model, self.lora_path))

    def _adapters(self, pairs: list[tuple[int, float]]) -> dict[Any, float]:
        chosen = {}
        for i, scale in pairs:
            adapter = self.get("adapter", i)
            if adapter is not None:
                chosen[adapter] = scale
        return chosen

    def op_set_adapters(self, op: dict[str, Any]) -> None:
        context = self.get("context", op["c"])
        if context is not None:
            context.set_lora_adapters(self._adapters(op["adapters"]))

    def op_llama(self, op: dict[str, Any]) -> None:
        from llamacrab import Llama, RamCache

        cache = RamCache(capacity_bytes=1 << 22) if op["cache"] else None
        extra: dict[str, Any] = {
            "plain": {}, "lookup": {"prompt_lookup": 3},
            "draft": {"draft_model": self.model_path, "draft_max": 4},
            "vision": {"mmproj": self.vision_path, "mmproj_probe": False},
        }.get(op["extra"], {})  # fmt: skip
        if op["extra"] == "disk_cache":
            # Its writer may still be busy when the folder goes (a Llama dropped, not closed).
            folder = tempfile.TemporaryDirectory(prefix="lifecycle-cache-",
                                                 ignore_cleanup_errors=True)  # fmt: skip
            self.disk_caches.append(folder)
            cache, extra = None, {"prompt_cache": self.disk_caches[-1].name}
        llm = Llama(self.model_path, n_ctx=op["n_ctx"], n_batch=op["n_batch"], n_threads=1,
                    parallel=op["parallel"], cache=cache, seed=0, **extra)  # fmt: skip
        self.add("llama", llm)
        if op["lora"]:
            self.add("adapter", llm.load_lora(self.lora_path))

    def op_complete(self, op: dict[str, Any]) -> None:
        llm = self.get("llama", op["l"])
        if llm is None:
            return
        prompt, media = op["prompt"], []
        if op["image"]:  # a Llama without a projector refuses it (InvalidParameterError)
            prompt, media = f"<__media__> {prompt}", [_image()]
        llm.create_completion(
            prompt, media=media, max_tokens=op["max_tokens"], temperature=op["temperature"],
            n=op["n"], grammar=op["grammar"], stop=list(op["stop"]), logprobs=op["logprobs"],
            min_tokens=op["min_tokens"], echo=op["echo"], timeout=op["timeout"],
        )  # fmt: skip

    def op_chat(self, op: dict[str, Any]) -> None:
        llm = self.get("llama", op["l"])
        if llm is None:
            return
        response_format = {"type": "json_object"} if op["json"] else None
        llm.create_chat_completion(
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": op["content"]}],
            chat_format=op["format"], max_tokens=op["max_tokens"], response_format=response_format,
        )  # fmt: skip

    def op_stream(self, op: dict[str, Any]) -> None:
        llm = self.get("llama", op["l"])
        if llm is not None:
            self.add("stream", llm.stream_completion(op["prompt"], max_tokens=op["max_tokens"],
                                                     min_tokens=op["min_tokens"]))  # fmt: skip

    def op_next(self, op: dict[str, Any]) -> None:
        stream = self.get("stream", op["t"])
        if stream is None:
            return
        for _ in range(op["k"]):
            if next(stream, None) is None:
                break

    def op_stream_close(self, op: dict[str, Any]) -> None:
        stream = self.get("stream", op["t"])
        if stream is not None:
            stream.close()

    def op_stream_cancel(self, op: dict[str, Any]) -> None:
        stream = self.get("stream", op["t"])
        if stream is not None:
            stream.cancel()

    def op_cancel(self, op: dict[str, Any]) -> None:
        llm = self.get("llama", op["l"])
        if llm is not None:
            llm.cancel()

    def op_evaluate(self, op: dict[str, Any]) -> None:
        """Score tokens after what the memory holds; what it returns must be the rows asked
        for, finite or not (a tiny random model's logits are whatever they are)."""
        llm = self.get("llama", op["l"])
        if llm is None:
            return
        tokens = op["tokens"]
        logits = llm.evaluate(tokens, all_logits=op["all_logits"], after=op["after"],
                              slot=op["slot"])  # fmt: skip
        shape = (len(tokens), TINY_VOCAB) if op["all_logits"] else (TINY_VOCAB,)
        if logits.shape != shape:
            raise RuntimeError(f"evaluate returned {logits.shape}, not {shape}")

    def op_project(self, op: dict[str, Any]) -> None:
        """An image prompt evaluated by the projector itself into the Llama's context, at any
        position and sequence (a raw use: the Llama's slots are not told what it holds)."""
        llm = self.get("llama", op["l"])
        if llm is None:
            return
        with llm.tokenize_media("<__media__> the cat", [_image()]) as chunks:
            chunks.projector.evaluate(llm.context, chunks, op["pos"], op["seq"])

    def op_llama_lora(self, op: dict[str, Any]) -> None:
        llm = self.get("llama", op["l"])
        if llm is not None:
            self.add("adapter", llm.load_lora(self.lora_path, scale=op["scale"]))

    def op_llama_set_lora(self, op: dict[str, Any]) -> None:
        llm = self.get("llama", op["l"])
        if llm is not None:
            llm.set_lora_adapters(self._adapters(op["adapters"]))

    def op_llama_state(self, op: dict[str, Any]) -> None:
        llm = self.get("llama", op["l"])
        if llm is None:
            return
        action = op["action"]
        if action == "save":
            self.states.append(llm.save_state())
        elif action == "save_context":
            self.states.append(llm.save_state("context"))
        elif action == "load" and self.states:
            llm.load_state(self.states[-1])
        elif action == "load_corrupt" and self.states:
            from llamacrab import SavedState

            blob = bytearray(self.states[-1].to_bytes())
            for i in range(len(blob) // 3, len(blob), max(1, len(blob) // 5)):
                blob[i] ^= 0x5A
            llm.load_state(SavedState.from_bytes(bytes(blob)))
        else:
            llm.reset()

    def op_embed(self, op: dict[str, Any]) -> None:
        llm = self.get("llama", op["l"])
        if llm is not None:
            llm.embed("the cat")

    def op_close(self, op: dict[str, Any]) -> None:
        obj = self.get(op["kind"], op["i"])
        if obj is not None and hasattr(obj, "close"):
            obj.close()

    def op_drop(self, op: dict[str, Any]) -> None:
        live = self.objects[op["kind"]]
        indices = [n for n, o in enumerate(live) if o is not None]
        if indices:
            with self.lock:
                live[indices[op["i"] % len(indices)]] = None

    def op_gc(self, op: dict[str, Any]) -> None:
        gc.collect()

    def op_sleep(self, op: dict[str, Any]) -> None:
        time.sleep(op["seconds"])

    def op_thread(self, op: dict[str, Any]) -> None:
        thread = self.spawn(self.run, op["inner"])
        if op["join"]:
            thread.join(THREAD_JOIN_SECONDS)

    def op_join(self, op: dict[str, Any]) -> None:
        self.join_threads()

    def op_close_during(self, op: dict[str, Any]) -> None:
        """Close the Llama (or its context, or its model) while another thread works on it:
        generates, tokenizes, creates a context, sampler or adapter for its model, ..."""
        from llamacrab import Context, ContextParams, LoraAdapter, SamplerChain, SamplingOptions

        llm = self.get("llama", op["l"])
        if llm is None:
            return
        started = threading.Event()
        model, work = llm.model, op["work"]
        text = PROMPTS[1] * 2000  # tokenizing it takes a while

        def run() -> None:
            started.set()
            if work == "tokenize":
                model.vocab.tokenize(text)
            elif work == "detokenize":
                model.vocab.detokenize(list(range(3, 200)) * 2000)
            elif work == "context":
                Context(model, ContextParams(n_ctx=2048, n_threads=1)).close()
            elif work == "sampler":
                grammar = "root ::= " + " | ".join(f'"w{i}" [a-z]*' for i in range(2000))
                SamplerChain(model, SamplingOptions(grammar=grammar)).close()
            elif work == "adapter":
                LoraAdapter(model, self.lora_path).close()
            elif work == "metadata":
                for _ in range(200):
                    _ = model.metadata, model.chat_template(), model.vocab.eog_tokens
            elif work == "embed":
                llm.embed("the cat")
            elif work == "image":
                llm.create_completion("<__media__> the cat", media=[_image(64)], max_tokens=16)
            elif work == "evaluate":  # a row of logits per token, then one token at a time
                slot = 0 if llm.scheduler is not None else None
                llm.evaluate(list(range(3, 60)), all_logits=True, after=0, slot=slot)
                for token in range(60, 120):
                    llm.evaluate([token], slot=slot)
            else:
                llm.create_completion(PROMPTS[1], max_tokens=64, min_tokens=64)

        self.spawn(self.run, {"op": "_call", "call": run})
        started.wait(5)
        time.sleep(op["delay"])
        target = {"llama": llm, "context": llm.context, "model": llm.model}[op["what"]]
        target.close()

    def op_fork(self, op: dict[str, Any]) -> None:
        """Fork, whatever other threads are doing; the child checks itself and reports through
        its exit status and a pipe. A hang or a signal death of the child is unclean here."""
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            code, problem = 1, "the forked child failed before reporting"
            try:
                problem = self._in_forked_child(op["leave"])
                code = 0 if problem is None else 1
            except BaseException as error:  # the child must never return into the harness
                problem = f"{type(error).__name__}: {error}"
            finally:
                with contextlib.suppress(OSError):
                    os.write(write_end, (problem or "").encode()[:4000])
                os._exit(code)
        os.close(write_end)
        deadline = time.monotonic() + FORKED_CHILD_SECONDS
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                os.close(read_end)
                raise RuntimeError(f"the forked child hung ({FORKED_CHILD_SECONDS} s)")
            time.sleep(0.01)
        with os.fdopen(read_end, "rb") as pipe:
            problem = pipe.read().decode(errors="replace")
        if problem:
            raise RuntimeError(f"the forked child: {problem}")

    def _in_forked_child(self, leave: str) -> str | None:
        """What went wrong in a forked child, or None: every inherited handle and Llama is
        refused (ForkedHandleError) and closes at once; an inherited stream ends or raises a
        LlamaError (never waits for the parent's engine); a model of its own works."""
        from llamacrab import ForkedHandleError, Llama, LlamaError
        from llamacrab._native.handle import NativeHandle

        for stream in [s for s in self.objects["stream"] if s is not None]:
            with contextlib.suppress(LlamaError):
                next(stream, None)
        inherited = [o for kind in KINDS if kind != "stream" for o in self.objects[kind]
                     if o is not None]  # fmt: skip
        for obj in inherited:
            try:
                if isinstance(obj, NativeHandle):
                    with obj.in_flight():
                        return f"an inherited {obj.kind} was usable"
                elif isinstance(obj, Llama):
                    obj.create_completion("the cat", max_tokens=1)
                    return "an inherited Llama completed"
            except ForkedHandleError:
                pass
            if hasattr(obj, "close"):
                obj.close()
        with Llama(self.model_path, n_ctx=128, n_threads=2) as own:
            own.create_completion("the cat", max_tokens=2)
        if leave == "exit_hooks":  # what sys.exit() runs, with the parent's objects alive
            atexit._run_exitfuncs()
        return None

    def op_reenter(self, op: dict[str, Any]) -> None:
        """A completion whose custom sampler, at its ``at``-th token, uses a Llama (this one
        or another): what it gets is the sampler's business, but the completion must end,
        and a close of its own Llama (refused from inside) must leave that Llama open."""
        from llamacrab import CustomSampler

        llm, target = self.get("llama", op["l"]), self.get("llama", op["target"])
        if llm is None or target is None:
            return
        machine, action = self, op["action"]

        class Reenter(CustomSampler):
            calls = 0

            def apply(self, candidates: Any) -> None:
                self.calls += 1
                if self.calls == op["at"] + 1:
                    machine.run({"op": "_call", "call": lambda: _reentry(target, action)})

        # Only where no other thread of the program runs: one of those may close it. Nor from
        # a thread of the program's own (where the program goes on meanwhile, and the thread
        # may not be in self.threads yet: seed 2045 closed the Llama from there).
        alone = (
            threading.current_thread() is threading.main_thread()
            and not any(thread.is_alive() for thread in self.threads)
            and not llm.closed
        )
        try:
            llm.create_completion("the cat", max_tokens=4, custom_samplers=[Reenter()])
        finally:
            if target is llm and alone and action.startswith("close") and llm.closed:
                raise RuntimeError(f"{action} from inside its own generation closed the Llama")

    def op__call(self, op: dict[str, Any]) -> None:
        op["call"]()

    def op_exit(self, op: dict[str, Any]) -> None:
        """Leave work in flight for the interpreter's exit (the child returns right after)."""
        from llamacrab import Llama

        mode = op["mode"]
        if mode == "parallel_streams":
            llm = self.add("llama", Llama(self.model_path, n_ctx=512, n_threads=1, parallel=3))
            for _ in range(3):
                stream = self.add("stream", llm.stream_completion(PROMPTS[1], max_tokens=400))
                next(stream, None)
            return
        extra = {"encoding_image": {"mmproj": self.vision_path, "mmproj_probe": False},
                 "drafting": {"draft_model": self.model_path}}.get(mode, {})  # fmt: skip
        llm = self.add("llama", Llama(self.model_path, n_ctx=2048, n_batch=512, n_threads=1,
                                      **extra))  # fmt: skip
        if mode == "open_stream":
            stream = self.add("stream", llm.stream_completion(PROMPTS[1], max_tokens=2000))
            next(stream, None)
            return
        started = threading.Event()

        def generate() -> None:
            started.set()
            with contextlib.suppress(Exception):  # the interpreter is leaving: any outcome
                if mode == "encoding_image":
                    while True:
                        llm.create_completion("<__media__>", media=[_image(64)], max_tokens=1)
                llm.create_completion(PROMPTS[1] * 4, max_tokens=None, min_tokens=1500)

        daemon = mode != "decoding_thread"
        thread = threading.Thread(target=generate, daemon=daemon)
        thread.start()
        started.wait(5)
        time.sleep(0.05)
        if mode == "closing":
            threading.Thread(target=llm.close, daemon=True).start()
