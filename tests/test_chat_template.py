"""Chat templates: the built-in Qwen3.5/3.6 one, templates from GGUF files and HF directories, HF's rendering
environment (globals, filters, sandbox) and the errors."""

import datetime
import json

import gguf
import pytest

from hybridlm.chat_template import BUILTIN_TEMPLATE, ChatTemplate
from hybridlm.checkpoints.gguf_header import read_header
from hybridlm.tokenizer import Tokenizer

CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "Add the numbers.\n</think>\n\n2+2 = 4."},
    {"role": "user", "content": "And 3+3? 日本語で 🙂"},
]
HISTORY = (
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n2+2 = 4.<|im_end|>\n"  # reasoning before the last user query is dropped
    "<|im_start|>user\nAnd 3+3? 日本語で 🙂<|im_end|>\n"
)
SIMPLE = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ eos_token }}"


def write_gguf(path, template=None, *, tokens=("<|endoftext|>", "<|im_end|>", "a")):
    """A GGUF file with no tensors: a small vocabulary (bos 0, eos 1) and `template` as its chat template."""
    writer = gguf.GGUFWriter(str(path), "qwen35moe")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(list(tokens))
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_builtin_renders_a_conversation_with_thinking_on_and_off():
    t = ChatTemplate.builtin()
    assert t.render(CONVERSATION) == HISTORY + "<|im_start|>assistant\n<think>\n"
    assert t.render(CONVERSATION, enable_thinking=False) == (
        HISTORY + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert t.render(CONVERSATION, add_generation_prompt=False) == HISTORY


def test_builtin_system_message_and_reasoning_of_the_current_turn():
    t = ChatTemplate.builtin()
    messages = [
        {"role": "system", "content": "  Be brief.\n"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "greet back</think>\n\nHello!"},
    ]
    # an assistant turn after the last user query keeps its reasoning; content and system text are trimmed
    assert t.render(messages, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\ngreet back\n</think>\n\nHello!<|im_end|>\n"
    )
    # Qwen3.6's preserve_thinking keeps the reasoning of earlier turns too; reasoning_content is read as well
    kept = t.render(
        [dict(CONVERSATION[1], content="2+2 = 4.", reasoning_content="Add.")] + CONVERSATION[2:],
        template_vars={"preserve_thinking": True},
    )
    assert kept.startswith("<|im_start|>assistant\n<think>\nAdd.\n</think>\n\n2+2 = 4.<|im_end|>\n")


def test_builtin_prompt_tokenizes_to_the_special_tokens():
    tok = Tokenizer()
    ids = tok.encode(ChatTemplate.builtin().render(CONVERSATION))
    im_start, think = tok.encode("<|im_start|>"), tok.encode("<think>")
    assert len(im_start) == 1 and len(think) == 1
    assert ids.count(im_start[0]) == 4 and ids.count(tok.eos_token_id) == 3 and ids[-2] == think[0]


def test_builtin_refuses_what_qwen_templates_refuse():
    t = ChatTemplate.builtin()
    with pytest.raises(ValueError, match="No user query found"):
        t.render([{"role": "assistant", "content": "hi"}])
    with pytest.raises(ValueError, match="System message must be at the beginning"):
        t.render([{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}])
    with pytest.raises(ValueError, match="Unexpected message role") as e:
        t.render([{"role": "user", "content": "hi"}, {"role": "tool", "content": "{}"}])
    assert "built-in" in str(e.value)
    with pytest.raises(ValueError, match="No messages provided"):
        t.render([])


def test_gguf_chat_template_and_its_tokens(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", SIMPLE)
    for t in (
        ChatTemplate.from_gguf(path),
        ChatTemplate.from_gguf(read_header(path)),
        ChatTemplate.for_model(path),
    ):
        assert t.source == SIMPLE and (t.bos_token, t.eos_token) == ("<|endoftext|>", "<|im_end|>")
        assert t.render(CONVERSATION[:1]) == "<|endoftext|>[user]What is 2+2?<|im_end|>"
    assert "tokenizer.chat_template" in ChatTemplate.from_gguf(path).origin
    # named templates: the writer stores "default" as tokenizer.chat_template
    named = write_gguf(
        tmp_path / "named.gguf", [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    )
    assert ChatTemplate.from_gguf(named).source == "D"


def test_gguf_without_a_template_gets_the_builtin(tmp_path):
    t = ChatTemplate.for_model(write_gguf(tmp_path / "plain.gguf"))
    assert t.source == BUILTIN_TEMPLATE and t.eos_token == "<|im_end|>"
    assert ChatTemplate.for_model(None).source == BUILTIN_TEMPLATE


def test_malformed_gguf_template_names_the_file(tmp_path):
    path = write_gguf(tmp_path / "bad.gguf", "{% for m in messages %}{{ m.content }}")
    with pytest.raises(ValueError, match=r"bad\.gguf \(tokenizer\.chat_template\) does not compile: line 1"):
        ChatTemplate.for_model(path)


def test_hf_directory_templates(tmp_path):
    config = {
        "chat_template": SIMPLE,
        "bos_token": None,
        "eos_token": {"content": "<|im_end|>", "lstrip": False},
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    t = ChatTemplate.for_model(tmp_path)
    assert (t.source, t.bos_token, t.eos_token) == (SIMPLE, "", "<|im_end|>")
    assert t.render(CONVERSATION[:1]) == "[user]What is 2+2?<|im_end|>"
    config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.from_hf_dir(tmp_path).source == "D"
    (tmp_path / "chat_template.jinja").write_text("J{{ eos_token }}")  # overrides the config's, as in HF
    assert ChatTemplate.from_hf_dir(tmp_path).render(CONVERSATION) == "J<|im_end|>"


def test_hf_directory_without_a_template_gets_the_builtin(tmp_path):
    assert ChatTemplate.from_hf_dir(tmp_path).source == BUILTIN_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert ChatTemplate.for_model(tmp_path).source == BUILTIN_TEMPLATE


def test_hf_directory_errors_name_the_file(tmp_path):
    config = tmp_path / "tokenizer_config.json"
    config.write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        ChatTemplate.from_hf_dir(tmp_path)
    config.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}]}))
    with pytest.raises(ValueError, match="none named 'default'"):
        ChatTemplate.from_hf_dir(tmp_path)
    config.write_text(json.dumps({"chat_template": "{{ messages[0].content }"}))
    with pytest.raises(ValueError, match=r"tokenizer_config\.json \(chat_template\) does not compile"):
        ChatTemplate.from_hf_dir(tmp_path)


def test_for_model_refuses_what_is_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError):
        ChatTemplate.for_model(tmp_path / "missing.gguf")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="neither a checkpoint directory nor a GGUF file"):
        ChatTemplate.for_model(tmp_path / "notes.txt")


def test_malformed_template_names_its_origin_and_the_jinja_error():
    with pytest.raises(ValueError, match=r"from my-template does not compile: line 2: .*'endif'") as e:
        ChatTemplate("ok\n{% if messages %}{{ 1 }}{% endfor %}", origin="my-template")
    assert isinstance(e.value.__cause__, Exception)
    with pytest.raises(ValueError, match="given template"):
        ChatTemplate("{{ ")


def test_raise_exception_and_render_errors_become_value_errors():
    with pytest.raises(ValueError, match="from given template: Only user turns, please"):
        ChatTemplate("{{ raise_exception('Only user turns, please') }}").render(CONVERSATION)
    with pytest.raises(ValueError, match="TypeError"):
        ChatTemplate("{{ messages[0].content + 1 }}").render(CONVERSATION)
    with pytest.raises(ValueError, match="unsafe|not safe|immutable|access"):  # the sandbox forbids mutation
        ChatTemplate("{{ messages.append(1) }}").render(CONVERSATION)


def test_hf_globals_and_filters():
    msgs = [{"role": "user", "content": 'café <b>"x"</b> 日本'}]
    assert ChatTemplate("{{ messages | tojson }}").render(msgs) == json.dumps(msgs, ensure_ascii=False)
    assert ChatTemplate("{{ messages[0] | tojson(indent=2, sort_keys=true) }}").render(msgs) == json.dumps(
        msgs[0], ensure_ascii=False, indent=2, sort_keys=True
    )
    year = ChatTemplate("{{ strftime_now('%Y') }}").render(msgs)
    assert year in {str(datetime.datetime.now().year), str(datetime.datetime.now().year - 1)}
    loop = "{% for i in [1, 2, 3] %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    assert ChatTemplate(loop).render(msgs) == "1"
    tagged = "{% for m in messages %}{% generation %}<{{ m.role }}>{% endgeneration %}{% endfor %}"
    assert ChatTemplate(tagged).render(msgs) == "<user>"
    # trim_blocks / lstrip_blocks as HF sets them
    assert ChatTemplate("  {% if true %}\nA\n  {% endif %}\nB").render(msgs) == "A\nB"


@pytest.mark.parametrize(
    "messages, where",
    [
        ({"role": "user", "content": "hi"}, "list of dicts"),
        ([{"role": "user", "content": "hi"}, "hello"], r"messages\[1\] must be a dict"),
        ([{"content": "hi"}], r"messages\[0\]\['role'\] must be a string; it is missing"),
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": None}],
            r"messages\[1\]\['content'\].*NoneType",
        ),
        ([{"role": 1, "content": "hi"}], r"messages\[0\]\['role'\].*int"),
    ],
    ids=["not-a-list", "not-a-dict", "no-role", "none-content", "int-role"],
)
def test_bad_messages_name_the_index(messages, where):
    with pytest.raises(ValueError, match=where):
        ChatTemplate.builtin().render(messages)
