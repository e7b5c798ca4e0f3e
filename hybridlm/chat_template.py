"""Chat templates: a conversation (a list of messages) -> the prompt text the model was trained on.

A template is the Jinja2 source a checkpoint ships (the GGUF key `tokenizer.chat_template`, or an HF
directory's `chat_template.jinja` / `tokenizer_config.json`), rendered the way HF transformers'
`apply_chat_template` renders it: an `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`
with the `loopcontrols` extension, a `{% generation %}` block tag, the globals `raise_exception` and
`strftime_now`, and a `tojson` filter that keeps non-ASCII text and does not HTML-escape. A checkpoint without
one gets `BUILTIN_TEMPLATE`, the text-only part of the Qwen3.5/3.6 template.

Source: transformers `utils/chat_template_utils.py` (`_compile_jinja_template`, `render_jinja_template`); the
Qwen3.5 / Qwen3.6 `chat_template.jinja` of the HF model repositories.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hybridlm.checkpoints.gguf_header import Header, read_header

GGUF_CHAT_TEMPLATE_KEY = "tokenizer.chat_template"

# The Qwen3.5/3.6 template without tools, tool calls and images/videos: same text for text-only messages.
# Thinking: the generation prompt opens a <think> block (the model reasons first), or with
# enable_thinking=False closes an empty one; earlier assistant turns keep their reasoning only after the last
# user query (or with preserve_thinking=True, Qwen3.6's switch).
BUILTIN_TEMPLATE = """\
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content|trim + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set content = message.content|trim %}
        {%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = message.content|trim %}
    {%- if message.role == "system" %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')
                    .split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- set reasoning_content = reasoning_content|trim %}
        {%- if (preserve_thinking is defined and preserve_thinking is true)
                or (loop.index0 > ns.last_query_index) %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content + '\\n</think>\\n\\n'
                + content }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}
"""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: HF marks assistant text with it for training masks; rendering
    keeps the body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format):  # noqa: A002  (the name templates call it with)
    return datetime.datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def check_messages(messages) -> None:
    """Checks that `messages` is a list of dicts whose "role" and "content" are strings (other keys, e.g.
    "reasoning_content", pass to the template as they are).

    Raises:
      ValueError: naming the first bad message by its index.
    """
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(
                f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}"
            )
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                got = "missing" if key not in message else f"a {type(message[key]).__name__}"
                raise ValueError(f"messages[{i}][{key!r}] must be a string; it is {got}")


class ChatTemplate:
    """A compiled chat template.

    Tools and tool calls are not part of `render`'s interface; the built-in template omits them (and images),
    a checkpoint's own template renders its text-only branches.

    Args:
      source: the Jinja2 template text.
      bos_token, eos_token: the strings templates read as `bos_token` / `eos_token`.
      origin: where `source` came from, named in errors (a file path and key, or "built-in").

    Raises:
      ValueError: `source` does not compile (the message names `origin`, the line and Jinja's error).
    """

    def __init__(
        self, source: str, *, bos_token: str = "", eos_token: str = "", origin: str = "given template"
    ):
        if not isinstance(source, str):
            raise ValueError(f"chat template from {origin} must be a string, got {type(source).__name__}")
        self.source, self.bos_token, self.eos_token, self.origin = source, bos_token, eos_token, origin
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(
                f"chat template from {origin} does not compile: line {e.lineno}: {e.message}"
            ) from e

    def __repr__(self) -> str:
        return f"ChatTemplate(origin={self.origin!r}, {len(self.source)} chars)"

    @classmethod
    def builtin(cls) -> ChatTemplate:
        """The Qwen3.5/3.6 template, text only (`BUILTIN_TEMPLATE`); eos_token <|im_end|>, no bos_token."""
        return cls(BUILTIN_TEMPLATE, eos_token="<|im_end|>", origin="built-in Qwen3.5/3.6 template")

    @classmethod
    def from_gguf(cls, path_or_header: str | os.PathLike | Header) -> ChatTemplate:
        """The template of a GGUF file (`tokenizer.chat_template`), with the file's bos/eos token strings;
        `builtin()` when the file has none.

        Raises:
          GGUFError: a malformed header.
          ValueError: the key is not a string, or the template does not compile.
        """
        if isinstance(path_or_header, Header):
            header, where = path_or_header, "GGUF header"
        else:
            header, where = read_header(path_or_header), os.fspath(path_or_header)
        entry = header.metadata.get(GGUF_CHAT_TEMPLATE_KEY)
        if entry is None:
            return cls.builtin()
        origin = f"{where} ({GGUF_CHAT_TEMPLATE_KEY})"
        if not isinstance(entry[1], str):
            raise ValueError(f"{origin} must be a string, got {type(entry[1]).__name__}")
        tokens = header.metadata.get("tokenizer.ggml.tokens", (None, None))[1]
        tokens = tokens[1] if isinstance(tokens, tuple) else []  # arrays are (element type, values)

        def token(name: str) -> str:
            """The text of token `tokenizer.ggml.{name}_token_id`, or "" when the file lacks it."""
            i = header.metadata.get(f"tokenizer.ggml.{name}_token_id", (None, None))[1]
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else ""

        return cls(entry[1], bos_token=token("bos"), eos_token=token("eos"), origin=origin)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> ChatTemplate:
        """The template of an HF checkpoint directory: `chat_template.jinja` if present (it overrides the
        config, as in transformers), else `tokenizer_config.json`'s "chat_template" (a string, or a list of
        {"name", "template"} of which "default" is taken), with that file's bos/eos tokens; else `builtin()`.

        Raises:
          ValueError: unreadable JSON, a template list without "default", or a template that does not compile.
        """
        path = os.fspath(path)
        config_path = os.path.join(path, "tokenizer_config.json")
        config = {}
        if os.path.isfile(config_path):
            try:
                with open(config_path, encoding="utf-8") as f:
                    config = json.load(f)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{config_path} is not valid JSON: {e}") from None
            if not isinstance(config, dict):
                raise ValueError(f"{config_path} must hold a JSON object")
        tokens = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}
        jinja_path = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                return cls(f.read(), **tokens, origin=jinja_path)
        source = config.get("chat_template")
        origin = f"{config_path} (chat_template)"
        if source is None:
            return cls.builtin()
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            if "default" not in named:
                raise ValueError(
                    f"{origin} lists templates {sorted(map(str, named))} but none named 'default'"
                )
            source, origin = named["default"], f"{config_path} (chat_template 'default')"
        return cls(source, **tokens, origin=origin)

    @classmethod
    def for_model(cls, path: str | os.PathLike | None) -> ChatTemplate:
        """The template of a checkpoint as `hybridlm.load` takes it: an HF directory (`from_hf_dir`), a GGUF
        file (`from_gguf`), or None (`builtin()`).

        Raises:
          FileNotFoundError: `path` does not exist.
          ValueError: `path` is neither a directory nor a GGUF file.
        """
        if path is None:
            return cls.builtin()
        path = os.fspath(path)
        if os.path.isdir(path):
            return cls.from_hf_dir(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no checkpoint at {path}")
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return cls.from_gguf(path)
        raise ValueError(f"{path} is neither a checkpoint directory nor a GGUF file (magic {magic!r})")

    def render(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        template_vars: Mapping[str, object] | None = None,
    ) -> str:
        """The prompt text of a conversation.

        Args:
          messages: [{"role": "system" | "user" | "assistant", "content": str}, ...]; extra keys (e.g.
            "reasoning_content") reach the template.
          add_generation_prompt: end with the header of the assistant's next turn.
          enable_thinking: False asks Qwen templates for an answer without reasoning (an empty think block).
          template_vars: further variables for the template (e.g. {"preserve_thinking": True} for Qwen3.6);
            they override the ones above.

        Raises:
          ValueError: a bad message (named by index), or an error raised while rendering, `raise_exception`
            included (the message names the template's origin).
        """
        check_messages(messages)
        variables = dict(
            messages=[dict(m) for m in messages],
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        variables.update(template_vars or {})
        try:
            return self._template.render(**variables)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template from {self.origin}: {e}") from e
        except (TypeError, AttributeError, KeyError, IndexError, ValueError, ArithmeticError) as e:
            raise ValueError(f"chat template from {self.origin} failed: {type(e).__name__}: {e}") from e


def _token_text(value) -> str:
    """A tokenizer_config.json token entry: a string, an AddedToken dict ({"content": ...}) or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""
