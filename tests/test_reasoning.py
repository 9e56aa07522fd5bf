"""Reasoning (<think>...</think>) split from the answer, however the text is cut into deltas."""

import copy
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import make_engine

from localllm.reasoning import ThinkSplitter, opened, reasons
from localllm.reply_stream import ReplyStream


def feed_in_pieces(text: str, cuts: list[int], thinking: bool = False) -> tuple[str, str]:
    s = ThinkSplitter(thinking)
    r, a = "", ""
    for lo, hi in zip([0] + cuts, cuts + [len(text)]):
        dr, da = s.feed(text[lo:hi])
        r, a = r + dr, a + da
    fr, fa = s.flush()
    return r + fr, a + fa


CASES = [
    # (model output, starts inside <think>, reasoning, answer)
    ("<think>\nLet me add.\n</think>\n\nTwo.", False, "\nLet me add.\n", "Two."),
    ("<think>\n\n</think>\n\nHi", False, "\n\n", "Hi"),  # enable_thinking=False, emitted by the model
    ("Plain answer, <think> mentioned later.", False, "", "Plain answer, <think> mentioned later."),
    ("I reason.\n</think>\n\nAnswer <b>", True, "I reason.\n", "Answer <b>"),  # the prompt opened it
    ("<think>never closed", False, "never closed", ""),
    ("<thin", False, "", "<thin"),  # a tag that never completes is text
    ("a < b", False, "", "a < b"),
    ("\n<think>x</think>y", False, "x", "y"),
]


@pytest.mark.parametrize("text,thinking,reasoning,answer", CASES)
def test_every_cut_gives_the_same_split(text, thinking, reasoning, answer):
    whole = ReplyStream(reasoning=True, inside=thinking).whole(text)
    assert (whole.reasoning, whole.content) == (reasoning, answer)
    for i in range(len(text) + 1):  # one cut anywhere, tags included
        assert feed_in_pieces(text, [i], thinking) == (reasoning, answer), i
    rng = random.Random(0)
    for _ in range(50):  # several cuts, one character per delta included
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 6)))) if len(text) > 1 else []
        assert feed_in_pieces(text, cuts, thinking) == (reasoning, answer), cuts
    assert feed_in_pieces(text, list(range(1, len(text))), thinking) == (reasoning, answer)


# gpt-oss's harmony replies: (model output as rendered, reasoning, answer)
HARMONY_CASES = [
    ("<|channel|>analysis<|message|>User says hi.<|end|><|start|>assistant<|channel|>final<|message|>Hello!",
     "User says hi.", "Hello!"),
    ("<|channel|>analysis<|message|>a <| b |> c<|end|><|start|>assistant<|channel|>final<|message|>x<|y|>z",
     "a <| b |> c", "x<|y|>z"),  # "<|" that starts no marker is text
    ("<|channel|>final<|message|>Only an answer.<|return|>ignored", "", "Only an answer."),
    ("No header at all <b>", "", "No header at all <b>"),
    ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>",
     "", '{"city": "Paris"}'),
    ("<|channel|>analysis<|message|>cut off mid-reasoning <|cha", "cut off mid-reasoning <|cha", ""),
]


def feed_harmony(text: str, cuts: list[int]) -> tuple[str, str]:
    s = ReplyStream(reasoning="harmony")
    r, a = "", ""
    for lo, hi in zip([0] + cuts, cuts + [len(text)]):
        d = s.feed(text[lo:hi])
        r, a = r + d.reasoning, a + d.content
    d = s.finish()
    return r + d.reasoning, a + d.content


@pytest.mark.parametrize("text,reasoning,answer", HARMONY_CASES)
def test_harmony_every_cut_gives_the_same_split(text, reasoning, answer):
    """The analysis channel is reasoning, the final (or any other) channel the answer; headers,
    roles and markers dropped; the same split whatever the deltas."""
    assert feed_harmony(text, []) == (reasoning, answer)
    for i in range(len(text) + 1):
        assert feed_harmony(text, [i]) == (reasoning, answer), i
    assert feed_harmony(text, list(range(1, len(text)))) == (reasoning, answer)


HARMONY_CALLS = [
    # the recipient in the header, after the channel
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
    "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>",
    # the recipient after the role, the format in the header
    "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to=functions.get_weather"
    "<|channel|>commentary json<|message|>{\"city\": \"Paris\"}<|call|>",
]


@pytest.mark.parametrize("text", HARMONY_CALLS)
def test_harmony_tool_calls(text):
    """A harmony message to functions.NAME is a tool call of NAME with its text as the arguments (in
    either place harmony puts the recipient), whatever the deltas; never content. A call of a tool
    not offered, or arguments that are no JSON object, come back as content."""
    from localllm.tool_calls import ToolCall

    def run(tools, cuts):
        s = ReplyStream(reasoning="harmony", tools=tools)
        parts = [s.feed(text[lo:hi]) for lo, hi in zip([0] + cuts, cuts + [len(text)])] + [s.finish()]
        return ("".join(p.reasoning for p in parts), "".join(p.content for p in parts),
                [(c.name, c.arguments) for p in parts for c in p.tool_calls])

    for cuts in ([], [len(text) // 2], list(range(1, len(text)))):
        assert run({"get_weather"}, cuts) == ("Need the weather.", "", [("get_weather", {"city": "Paris"})])
        assert run({"other"}, cuts) == ("Need the weather.", '{"city": "Paris"}', [])
    assert isinstance(ReplyStream(reasoning="harmony", tools={"get_weather"}).whole(text).tool_calls[0], ToolCall)
    bad = text.replace('{"city": "Paris"}', "not json")
    assert ReplyStream(reasoning="harmony", tools={"get_weather"}).whole(bad).content == "not json"


HARMONY_TOKENS = ["<|start|>", "<|end|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|return|>", "<|call|>"]


def harmony_tokenizer(tmp_path, gguf_path):
    """The embedded model's GGUF vocabulary with harmony's special tokens added, o200k's pre-tokenizer."""
    from test_families import tokenizer_fields

    from localllm.tokenizer import LLMTokenizer

    meta = {k: v for k, v, _, _ in tokenizer_fields(gguf_path)}
    tokens = list(meta["tokenizer.ggml.tokens"]) + HARMONY_TOKENS
    meta |= {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.pre": "gpt-4o",
             "tokenizer.ggml.token_type": list(meta["tokenizer.ggml.token_type"]) + [3] * len(HARMONY_TOKENS)}
    return LLMTokenizer.from_gguf(meta, str(tmp_path / "x.gguf"))


@pytest.mark.parametrize("source", ["gguf", "hf"])
def test_harmony_markup_is_rendered_and_ends_the_reply(tmp_path, gguf_path, source):
    """A gpt-oss vocabulary, from a GGUF or a Hugging Face tokenizer.json: the markup tokens decode as
    text (the splitter needs them), the other special tokens stay hidden; <|return|> and <|call|> end
    a reply, <|end|> does not."""
    from localllm.tokenizer import LLMTokenizer

    extra = HARMONY_TOKENS
    tok = harmony_tokenizer(tmp_path, gguf_path)
    if source == "hf":
        tok.save_hf(tmp_path)
        tok = LLMTokenizer.from_dir(tmp_path)
    ids = {t: tok.tok.token_to_id(t) for t in extra}
    text = "<|channel|>final<|message|>Hi<|return|>"
    enc = tok.encode(text)
    assert ids["<|channel|>"] in enc and ids["<|return|>"] in enc
    assert tok.decode(enc) == "<|channel|>final<|message|>Hi"  # <|return|> is hidden
    assert tok.decode(tok.encode("<|im_start|>x")) == "x"  # another special token: hidden as before
    assert {ids["<|return|>"], ids["<|call|>"]} <= tok.eos_ids and ids["<|end|>"] not in tok.eos_ids
    whole = ReplyStream(reasoning=reasons("{{ '<|channel|>' }}")).whole(tok.decode(enc))
    assert (whole.reasoning, whole.content) == ("", "Hi")


@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_a_forced_call_is_written_as_harmony_writes_it(tmp_path, gguf_path, choice):
    """tool_choice required (or a named tool) for a harmony model: its grammar takes the call as gpt-oss
    writes it, a commentary message to functions.NAME with the arguments' JSON under the tool's schema,
    ended by <|call|> (an end of the reply), and nothing else; the reply reads back as that call."""
    from localllm.structured import Constraint, Grammars
    from localllm.tool_calls import forcing_grammar, style_of

    tok = harmony_tokenizer(tmp_path, gguf_path)
    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
            "additionalProperties": False}
    tools = {"get_weather": city, "get_time": {"type": "object", "properties": {}}}
    style = style_of("{{- '<|start|>assistant<|channel|>final<|message|>' }}")
    grammars = Grammars(tok.tok.to_str, tok.vocab_size, sorted(tok.eos_ids))
    constraint = Constraint.make("grammar", forcing_grammar(tools, choice, style))

    def takes(text: str) -> bool:
        m = grammars.matcher(constraint)
        return all(m.consume_token(t) for t in tok.encode(text)) and m._m.is_accepting()

    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
    assert style == "harmony" and takes(call)
    assert not takes(call.replace('"Paris"', "3"))  # the tool's schema holds
    assert not takes(call.replace("<|call|>", ""))  # a call ends at <|call|>
    assert not takes('{"name": "get_weather", "arguments": {"city": "Paris"}}')  # the JSON style
    assert not takes("<|channel|>final<|message|>It is sunny.")
    assert takes(call.replace("get_weather", "get_time").replace('{"city": "Paris"}', "{}")) == (choice == "required")
    ids = tok.encode(call)
    assert ids[-1] in tok.eos_ids
    got = ReplyStream(reasoning="harmony", tools=set(tools)).whole(tok.decode(ids))
    assert [(c.name, c.arguments) for c in got.tool_calls] == [("get_weather", {"city": "Paris"})] and not got.content


def test_templates_and_prompts():
    assert reasons("... {{- '<think>\\n\\n</think>\\n\\n' }} ...") and not reasons("{{ messages }}") and not reasons(None)
    assert reasons("{{- '<|start|>assistant<|channel|>final<|message|>' }}") == "harmony"
    assert opened("<|im_start|>assistant\n<think>\n")
    assert not opened("<|im_start|>assistant\n<think>\n\n</think>\n\n") and not opened("hello")


# ---- front ends: the chat REPL and `run`, on a scripted reasoning model ----------------------

QWEN3_TEMPLATE = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
REPLY = "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"


class ScriptedReasoner:
    """The real engine's tokenizer and prompt encoding under Qwen3's chat template; generate()
    streams REPLY in small deltas (a random model does not write <think> tags)."""

    def __init__(self, engine, template: str = QWEN3_TEMPLATE, reply: str = REPLY):
        from localllm.chat import render_chat

        self._engine, self.tokenizer, self.max_model_len = engine, copy.copy(engine.tokenizer), engine.max_model_len
        self.tokenizer.chat_template = template
        self.render = lambda messages, **kw: render_chat(template, messages, **kw)
        self.prompts: list[str] = []
        self.reply = reply

    def encode_prompt(self, messages, **template_kwargs):
        text = self.render(messages, **template_kwargs)
        self.prompts.append(text)
        return self.tokenizer.encode(text)

    def generate(self, prompt, params):
        assert isinstance(prompt, list) and isinstance(prompt[0], int)  # encoded through encode_prompt
        pieces = [self.reply[i:i + 3] for i in range(0, len(self.reply), 3)]
        for i, p in enumerate(pieces):
            yield SimpleNamespace(delta=p, token_ids=list(range(i + 1)), finished=i == len(pieces) - 1,
                                  finish_reason="stop", num_prompt_tokens=len(prompt), num_cached_tokens=0)


@pytest.fixture
def reasoner(int4_model):
    return ScriptedReasoner(make_engine(int4_model))


def session_of(engine, **kw):
    from localllm.repl import ChatSession

    out, notes = [], []
    s = ChatSession(engine, "qwen3", out=out.append, note=notes.append, **kw)
    s.outputs, s.notes = out, notes
    return s


def test_chat_shows_reasoning_dimmed_and_keeps_only_the_answer(reasoner):
    from localllm.repl import DIM, UNDIM

    s = session_of(reasoner)
    s.dim = True  # as in a terminal
    s.handle("hi")
    assert "".join(s.outputs) == DIM + "The user greets me.\n" + UNDIM + "\nHello! How can I help?\n"
    assert s.messages[-1] == {"role": "assistant", "content": "Hello! How can I help?"}
    # the next turn's prompt carries the answer, not the reasoning (the template drops it anyway)
    s.handle("and?")
    assert "The user greets me." not in reasoner.prompts[-1] and "Hello! How can I help?" in reasoner.prompts[-1]


def test_chat_think_modes(reasoner):
    s = session_of(reasoner, think="hide")
    s.handle("hi")
    assert "".join(s.outputs) == "Hello! How can I help?\n" and not s.notes
    s.handle("/set think off")  # the template's enable_thinking=False: an empty reasoning block
    s.handle("hi again")
    assert reasoner.prompts[-1].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    s.handle("/set think on")
    s.handle("once more")  # not a terminal: the reasoning goes to the notes, the answer to out
    assert "The user greets me." in "".join(s.notes) and not reasoner.prompts[-1].endswith("</think>\n\n")
    s.notes.clear()
    s.handle("/set think loud")
    assert "usage: /set think on|hide|off" in "".join(s.notes) and s.think == "on"


@pytest.mark.parametrize("think", [None, True, False])
def test_run_prints_the_answer_and_the_reasoning_only_when_asked(reasoner, think, capsys):
    from localllm.cli import _stream_answer
    from localllm.sampling import SamplingParams

    _stream_answer(reasoner, [{"role": "user", "content": "hi"}], SamplingParams(), False, think)
    out = capsys.readouterr().out
    if think:
        assert out == "Thinking...\nThe user greets me.\n\n...done thinking.\n\nHello! How can I help?\n"
    else:
        assert out == "Hello! How can I help?\n"
    assert reasoner.prompts[-1].endswith("</think>\n\n") == (think is False)


# harmony's shape in a few lines (gpt-oss's own template adds a system message, tools, efforts)
HARMONY_TEMPLATE = ("{%- for m in messages %}<|start|>{{ m.role }}"
                    "{%- if m.role == 'assistant' %}<|channel|>final{%- endif %}<|message|>{{ m.content }}<|end|>"
                    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}")
HARMONY_REPLY = ("<|channel|>analysis<|message|>The user greets me.<|end|><|start|>assistant<|channel|>final"
                 "<|message|>Hello! How can I help?")


@pytest.mark.parametrize("think", [None, True])
def test_run_and_chat_split_a_harmony_reply(int4_model, think, capsys):
    """gpt-oss: `run` prints the final channel (the analysis one too, as Ollama's "Thinking...", when
    asked); the chat keeps the answer alone in the conversation."""
    from localllm.cli import _stream_answer
    from localllm.sampling import SamplingParams

    harmony = ScriptedReasoner(make_engine(int4_model), HARMONY_TEMPLATE, HARMONY_REPLY)
    _stream_answer(harmony, [{"role": "user", "content": "hi"}], SamplingParams(), False, think)
    out = capsys.readouterr().out
    want = "Hello! How can I help?\n"
    assert out == ("Thinking...\nThe user greets me.\n...done thinking.\n\n" + want if think else want)
    s = session_of(harmony, think="hide")
    s.handle("hi")
    assert "".join(s.outputs) == want and s.messages[-1] == {"role": "assistant", "content": "Hello! How can I help?"}
    s.handle("and?")  # the history holds the answer on the final channel, not the reasoning
    assert "<|channel|>final<|message|>Hello! How can I help?<|end|>" in harmony.prompts[-1]
    assert "The user greets me." not in harmony.prompts[-1]


def test_qwen3_template_renders_as_transformers_renders_it(tmp_path, int4_model):
    """Our jinja sandbox renders the family's template (tools, reasoning in the history,
    enable_thinking) exactly as transformers' apply_chat_template."""
    transformers = pytest.importorskip("transformers")
    from localllm.chat import render_chat

    int4_model.tokenizer.save_hf(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ref.chat_template = QWEN3_TEMPLATE
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "<think>\nCall the tool.\n</think>\n\nChecking.",
              "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": "18C"}, {"role": "user", "content": "Thanks"}]
    for kw in ({}, {"enable_thinking": False}, {"tools": tools}):
        want = ref.apply_chat_template(convo, tokenize=False, add_generation_prompt=True, **kw)
        assert render_chat(QWEN3_TEMPLATE, convo, **kw) == want, kw
