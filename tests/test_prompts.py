import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from fisher_select.errors import FisherSelectError
from fisher_select.calibration.prompts import PromptRecord, load_prompts, render_prompt

ARITHMETIC = Path(__file__).resolve().parents[1] / "recipes" / "data" / "arithmetic.jsonl"
WORDS = ["<unk>", "</s>", "hello", "world", "user", "assistant", "system", ":", "be", "nice"]
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


def make_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    backend = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    tokenizer.chat_template = chat_template
    return tokenizer


def ids(*words: str) -> list[int]:
    return [WORDS.index(w) for w in words]


def write_lines(tmp_path, lines) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def record(prompt=None, messages=None) -> PromptRecord:
    fields = {"prompt": prompt} if prompt is not None else {"messages": messages}
    return PromptRecord(index=0, prompt=prompt, messages=messages, fields=fields)


# --- load_prompts ----------------------------------------------------------------------


def test_load_prompts_reads_both_forms_and_keeps_fields(tmp_path):
    msgs = [{"role": "user", "content": "hello"}]
    path = write_lines(
        tmp_path,
        [
            json.dumps({"prompt": "hello world", "answer": 3}),
            "",
            "   ",
            json.dumps({"messages": msgs, "id": "b"}),
        ],
    )
    first, second = load_prompts(path)
    assert first == PromptRecord(0, "hello world", None, {"prompt": "hello world", "answer": 3})
    assert second.index == 3  # 0-based line index: blank lines still count
    assert second.prompt is None and second.messages == msgs and second.fields["id"] == "b"


def test_load_prompts_limit_takes_first(tmp_path):
    path = write_lines(tmp_path, [json.dumps({"prompt": f"p{i}"}) for i in range(5)] + ["not json"])
    assert [r.prompt for r in load_prompts(path, limit=2)] == ["p0", "p1"]
    with pytest.raises(FisherSelectError, match="not a positive integer"):
        load_prompts(path, limit=0)


def test_load_prompts_accepts_utf8_bom(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"prompt": "hello"}).encode() + b"\n")
    assert load_prompts(path)[0].prompt == "hello"


def test_arithmetic_recipe_loads():
    records = load_prompts(ARITHMETIC)
    assert len(records) == 512  # data: 512 distinct problems since issue 32 (was 64 with repeats)
    assert all(isinstance(r.fields["answer"], int) for r in records)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{bad json", r"prompts.jsonl:2: invalid JSON"),
        ("[1, 2]", r"prompts.jsonl:2: got list"),
        ('{"answer": 1}', r'prompts.jsonl:2: has neither of "prompt" and "messages"'),
        ('{"prompt": "a", "messages": []}', r'prompts.jsonl:2: has both'),
        ('{"prompt": 5}', r'prompts.jsonl:2: "prompt" is int; expected a string'),
        ('{"prompt": "  "}', r'prompts.jsonl:2: "prompt" is empty'),
        ('{"messages": []}', r'prompts.jsonl:2: "messages" must be a non-empty list'),
        ('{"messages": "hi"}', r'prompts.jsonl:2: "messages" must be a non-empty list'),
        ('{"messages": [{"role": "user"}]}', r"prompts.jsonl:2: messages\[0\] must be an object"),
        ('{"messages": [{"role": "user", "content": 3}]}', r"messages\[0\] must be an object"),
    ],
)
def test_load_prompts_reports_bad_line(tmp_path, line, message):
    path = write_lines(tmp_path, [json.dumps({"prompt": "ok"}), line])
    with pytest.raises(FisherSelectError, match=message):
        load_prompts(path)


def test_load_prompts_missing_and_empty_files(tmp_path):
    with pytest.raises(FisherSelectError, match="does not exist"):
        load_prompts(tmp_path / "none.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(FisherSelectError, match="empty.jsonl has no prompts"):
        load_prompts(tmp_path / "empty.jsonl")


def test_load_prompts_reports_non_utf8(tmp_path):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(FisherSelectError, match="latin.jsonl:2: not valid UTF-8"):
        load_prompts(path)


# --- render_prompt ---------------------------------------------------------------------


def test_render_plain_prompt_without_template():
    assert render_prompt(make_tokenizer(), record(prompt="hello world")) == ids("hello", "world")


def test_render_prompt_through_chat_template():
    tokenizer = make_tokenizer(TEMPLATE)
    got = render_prompt(tokenizer, record(prompt="hello world"))
    assert got == ids("user", ":", "hello", "world", "assistant", ":")
    assert all(type(i) is int for i in got)


def test_render_messages_through_chat_template():
    messages = [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hello"}]
    got = render_prompt(make_tokenizer(TEMPLATE), record(messages=messages))
    assert got == ids("system", ":", "be", "nice", "user", ":", "hello", "assistant", ":")


def test_render_messages_without_template_is_an_error():
    with pytest.raises(FisherSelectError, match="no chat template"):
        render_prompt(make_tokenizer(), record(messages=[{"role": "user", "content": "hello"}]))


def test_render_prompt_with_no_tokens_is_an_error():
    tokenizer = make_tokenizer()
    with pytest.raises(FisherSelectError, match="renders to no tokens"):
        render_prompt(tokenizer, record(prompt=""))


def test_render_reports_template_errors():
    template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(FisherSelectError, match="chat template rejected .*roles must alternate"):
        render_prompt(make_tokenizer(template), record(prompt="hello"))


def test_describe_names_index_line_and_truncated_text():
    long = PromptRecord(2, "x" * 100, None, {"prompt": "x" * 100})
    assert long.describe() == f"prompt 2 (line 3: {'x' * 60!r})"
    chat = PromptRecord(0, None, [{"role": "user", "content": "hi there"}], {})
    assert chat.preview() == "hi there"


def test_arithmetic_generator_reproduces_committed_file():
    import importlib.util

    script = ARITHMETIC.with_name("make_arithmetic.py")
    spec = importlib.util.spec_from_file_location("make_arithmetic", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    lines = [json.dumps(p) for p in module.make_problems()]
    assert ARITHMETIC.read_text(encoding="utf-8") == "\n".join(lines) + "\n"
    for problem in module.make_problems():
        assert problem["prompt"].endswith("Answer with the number only.")


def test_asking_for_more_prompts_than_the_file_has_is_an_error(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "p0"}\n{"prompt": "p1"}\n')
    with pytest.raises(FisherSelectError, match="3 prompts were asked for .* has only 2; pass --num-prompts 2"):
        load_prompts(path, limit=3)
    assert len(load_prompts(path, limit=2)) == 2


@pytest.mark.parametrize("name", ["gpt2", "llama-tied"])  # learned positions (n_positions) and RoPE (max_position_embeddings)
def test_prompts_longer_than_the_context_are_refused_before_sampling(name):
    from fisher_select import RLObjective, calibrate
    from tests.tiny import TinyTokenizer, tiny_model

    model = tiny_model(name)
    limit = getattr(model.config, "n_positions", None) or model.config.max_position_embeddings
    long = PromptRecord(1, " ".join(["3"] * (limit - 4)), None, {})
    prompts = [PromptRecord(0, "2 3", None, {}), long]
    calls = []
    with pytest.raises(FisherSelectError, match=rf"1 of 2 prompts do not fit the model's context of {limit} positions "
                                                 rf"with max_new_tokens=8: the longest, prompt 1 .* has {limit - 4} tokens; "
                                                 r".*lower --max-new-tokens to 4 or less"):
        calibrate(model, TinyTokenizer(64), prompts, RLObjective(lambda r, t: calls.append(t) or 0.0),
                  samples_per_prompt=2, max_new_tokens=8, progress=False)
    assert calls == []  # nothing was sampled
