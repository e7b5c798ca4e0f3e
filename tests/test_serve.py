"""`hybridlm serve`: the OpenAI-compatible server on a free localhost port (tiny random model), driven with
the real `openai` client, and with raw HTTP (httpx2, the openai client's own) for bad requests and
disconnects; `hybridlm chat` through `cli.main`; SIGTERM on a `hybridlm serve` process."""

import argparse
import asyncio
import contextlib
import io
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import openai
import pytest
import uvicorn

from hybridlm.chat import Chat
from hybridlm.cli import main
from hybridlm.cli_chat import chat_loop
from hybridlm.serve import FifoTurns, create_app, make_server
from hybridlm.tokenizer import Tokenizer

MODEL = "tiny-test"
CONTEXT = 1024  # the Chat's max_context: small, so that a prompt past it is cheap to send
LONG = 900  # max_tokens of a reply that a test stops early (it never runs to the end)
USER = {"role": "user", "content": "Name three colours."}


class RecordingChat(Chat):
    """A Chat that keeps every reply it hands out, to read a reply's statistics after the server ended it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.replies = []

    def complete_ids(self, ids, **kwargs):
        reply = super().complete_ids(ids, **kwargs)
        self.replies.append(reply)
        return reply


def _bound_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def _serving(server: uvicorn.Server):
    """Runs `server` in a thread on a free localhost port; yields its base URL; stops it at the end."""
    sock = _bound_socket()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120  # a guard against a hang, not a timing
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", thread
    finally:
        server.should_exit = True
        thread.join(120)
        sock.close()
        assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def chat(tiny_model):
    return RecordingChat(tiny_model, Tokenizer(), chunk_size=64, max_context=CONTEXT)


@pytest.fixture(scope="module")
def base_url(chat):
    config = uvicorn.Config(create_app(chat, MODEL), log_level="warning")
    with _serving(uvicorn.Server(config)) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=300)


def _events(response) -> list:
    """The data of a server-sent event stream: JSON objects, and the final "[DONE]"."""
    lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    return [line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]) for line in lines]


def _content(line: str) -> str | None:
    """The text of a chat chunk's event line, or None for other lines."""
    if not line.startswith("data: {"):
        return None
    choices = json.loads(line[6:])["choices"]
    return choices[0]["delta"].get("content") if choices else None


def test_models_lists_the_one_model(client, base_url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).owned_by == "hybridlm"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    r = httpx.get(base_url + "/v1/nothing")
    assert r.status_code == 404 and "/v1/nothing" in r.json()["error"]["message"]


def test_chat_completion_shapes_usage_and_content(client, chat):
    out = client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=5, temperature=0)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion" and out.model == MODEL
    assert out.created > 0 and len(out.choices) == 1
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.message.content == chat.stream([USER], max_tokens=5, temperature=0).text()
    usage = out.usage
    assert usage.prompt_tokens == len(chat.prompt_ids([USER])) and usage.completion_tokens == 5
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens
    # max_completion_tokens is the newer name of max_tokens
    newer = client.chat.completions.create(
        model=MODEL, messages=[USER], max_completion_tokens=5, temperature=0
    )
    assert newer.choices[0].message.content == choice.message.content


def test_completion_shapes_and_prompt_forms(client, chat):
    prompt = "The quick brown fox"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].text == chat.complete(prompt, max_tokens=4, temperature=0).text()
    ids = chat.tokenizer.encode(prompt)
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 4
    assert out.usage.total_tokens == len(ids) + 4
    for same in ([prompt], ids):  # a list of one text, and token ids
        again = client.completions.create(model=MODEL, prompt=same, max_tokens=4, temperature=0)
        assert again.choices[0].text == out.choices[0].text


def test_streamed_chat_equals_the_whole_reply(client, base_url):
    whole = client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=8, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[USER],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    # the raw stream of a text completion: chunks, then data: [DONE]
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    alone = httpx.post(base_url + "/v1/completions", json=body, timeout=300).json()
    with httpx.stream("POST", base_url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r)
    assert events[-1] == "[DONE]" and all(e["object"] == "text_completion" for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == alone["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_concurrent_clients_each_get_their_own_reply(base_url):
    topics = ["rivers", "the moon", "bread", "prime numbers"]

    def ask(i: int) -> str:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=300)
        messages = [{"role": "user", "content": f"Tell me about {topics[i]}."}]
        settings = dict(model=MODEL, messages=messages, max_tokens=6 + i, temperature=0)
        if i % 2:  # half of them stream
            chunks = client.chat.completions.create(**settings, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return client.chat.completions.create(**settings).choices[0].message.content

    alone = [ask(i) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(ask, range(4)))
    assert together == alone and len(set(alone)) == 4


def test_a_client_that_disconnects_frees_its_turn(client, chat, base_url):
    """A streaming client leaves mid-reply, another while queued behind it: both replies are closed, and the
    next request is answered (were they not, it would wait for LONG tokens first)."""
    body = {"model": MODEL, "messages": [USER], "max_tokens": LONG, "temperature": 0, "stream": True}
    before = len(chat.replies)
    with httpx.Client(timeout=300) as first_client, httpx.Client(timeout=300) as second_client:
        with first_client.stream("POST", base_url + "/v1/chat/completions", json=body) as first:
            lines = first.iter_lines()
            contents = 0
            while contents < 3:  # the first reply is decoding
                contents += bool(_content(next(lines)))
            with second_client.stream("POST", base_url + "/v1/chat/completions", json=body) as second:
                assert next(second.iter_lines()).startswith("data: ")  # the role chunk: it is queued
            next(lines)  # the first goes on after the second left
    out = client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 3
    first_reply, second_reply = chat.replies[before : before + 2]
    assert first_reply.stats.finish_reason is None and 3 <= first_reply.stats.completion_tokens < LONG
    assert second_reply.stats.completion_tokens == 0  # never started


DROP = object()  # a BAD_REQUESTS patch value: leave the field out

# name: (endpoint, the body (bytes) or a patch of a valid one, status, error param, error code)
BAD_REQUESTS = {
    "malformed JSON": ("chat", b'{"model": "tiny-test", "messages": [', 400, None, None),
    "not an object": ("chat", b"[1, 2]", 400, None, None),
    "missing messages": ("chat", {"messages": DROP}, 400, "messages", None),
    "missing model": ("completions", {"model": DROP}, 400, "model", None),
    "unknown model": ("chat", {"model": "gpt-4o"}, 404, "model", "model_not_found"),
    "negative max_tokens": ("chat", {"max_tokens": -3}, 400, "max_tokens", None),
    "zero max_tokens": ("completions", {"max_tokens": 0}, 400, "max_tokens", None),
    "max_tokens a string": ("chat", {"max_tokens": "5"}, 400, "max_tokens", None),
    "negative temperature": ("chat", {"temperature": -0.5}, 400, "temperature", None),
    "temperature a string": ("completions", {"temperature": "hot"}, 400, "temperature", None),
    "top_p zero": ("chat", {"top_p": 0}, 400, "top_p", None),
    "top_p above one": ("completions", {"top_p": 1.5}, 400, "top_p", None),
    "messages a string": ("chat", {"messages": "hello"}, 400, "messages", None),
    "content a number": ("chat", {"messages": [{"role": "user", "content": 7}]}, 400, "messages", None),
    "stream a string": ("chat", {"stream": "yes"}, 400, "stream", None),
    "stop a number": ("completions", {"stop": 5}, 400, "stop", None),
    "empty stop": ("chat", {"stop": [""]}, 400, "stop", None),
    "n of 2": ("chat", {"n": 2}, 400, None, None),
    "empty prompt": ("completions", {"prompt": ""}, 400, "prompt", None),
    "token id past the vocabulary": ("completions", {"prompt": [5, 10**6]}, 400, "prompt", None),
    "two prompts": ("completions", {"prompt": ["a", "b"]}, 400, None, None),
    "prompt past the context": (
        "chat",
        {"messages": [{"role": "user", "content": "word " * (CONTEXT + 50)}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
    "reply past the context": (
        "completions",
        {"max_tokens": CONTEXT},
        400,
        "prompt",
        "context_length_exceeded",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_requests_get_openai_error_bodies(case, base_url):
    endpoint, body, status, param, code = BAD_REQUESTS[case]
    if isinstance(body, dict):
        valid = {"model": MODEL, **({"messages": [USER]} if endpoint == "chat" else {"prompt": "Hello"})}
        body = json.dumps({k: v for k, v in {**valid, **body}.items() if v is not DROP})
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    r = httpx.post(base_url + path, content=body, headers={"Content-Type": "application/json"}, timeout=300)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["code"] == code


def test_bad_request_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=-1)
    with pytest.raises(openai.NotFoundError, match="gpt-4o"):
        client.chat.completions.create(model="gpt-4o", messages=[USER], max_tokens=2)


def test_a_second_turn_carries_the_first(client, chat):
    first = client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=6, temperature=0)
    reply = first.choices[0].message.content
    turn2 = [USER, {"role": "assistant", "content": reply}, {"role": "user", "content": "And three more?"}]
    second = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=6, temperature=0)
    assert second.usage.prompt_tokens == len(chat.prompt_ids(turn2)) > first.usage.total_tokens
    assert second.choices[0].message.content == chat.stream(turn2, max_tokens=6, temperature=0).text()
    # the first turn saved its history's state: the second resumes from it
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_fifo_turns_serve_in_arrival_order():
    async def scenario():
        turns = FifoTurns()
        a, b, c, d = (turns.request() for _ in range(4))
        assert a.done() and not any(t.done() for t in (b, c, d)) and turns.waiting == 3
        turns.withdraw(c)  # left while queued
        turns.release()
        assert b.done() and not d.done()
        turns.withdraw(b)  # gave up its turn: it passes on, past c
        assert d.done() and turns.waiting == 0
        e = turns.request()
        assert not e.done()
        turns.release()
        assert e.done()
        turns.release()
        assert turns.request().done()  # free again

    asyncio.run(scenario())


def test_stopping_the_server_ends_open_replies(chat):
    """should_exit (what Ctrl-C and SIGTERM set) ends a reply in flight with an error event and [DONE]."""
    server = make_server(chat, MODEL, log_level="warning")
    before = len(chat.replies)
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": LONG,
        "temperature": 0,
        "stream": True,
    }
    with _serving(server) as (url, thread):
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            lines = r.iter_lines()
            next(lines)
            server.should_exit = True
            events = [json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]" for x in lines if x]
        thread.join(120)
    assert events[-1] == "[DONE]" and "shutting down" in events[-2]["error"]["message"]
    assert chat.replies[before].stats.completion_tokens < LONG


def test_chat_command_keeps_the_conversation(capsys, monkeypatch, chat):
    calls = []
    real = Chat.stream

    def spy(self, messages, **settings):
        calls.append([dict(m) for m in messages])
        return real(self, messages, **settings)

    monkeypatch.setattr(Chat, "stream", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Name three colours.\n\nAnd three more?\n"))
    argv = ["chat", "--random-weights", "--max-tokens", "4", "--temperature", "0", "--max-context", "256"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert len(calls) == 2 and calls[0] == [USER]
    reply = calls[1][1]["content"]
    assert calls[1] == [
        USER,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And three more?"},
    ]
    # the same weights as the tiny model of the server's chat (tiny, seed 0): the same greedy reply
    assert reply == real(chat, [USER], max_tokens=4, temperature=0).text()
    assert out.startswith(reply + "\n") and out.count("\n") >= 2


def test_chat_loop_ends_at_exit(chat):
    args = argparse.Namespace(
        system="Be brief.", thinking=False, max_new_tokens=2, temperature=0.0, top_p=1.0
    )
    args.top_k, args.seed = 0, 0
    out = io.StringIO()
    assert chat_loop(chat, args, io.StringIO("Hi\n/exit\nnever read\n"), out) == 0
    assert out.getvalue().count("\n") == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "--port", "70000"], "--port must be 0-65535"),
        (["chat", "--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["chat", "--top-p", "0"], "--top-p"),
        (["serve", "--preset", "tiny"], "--preset tiny names an architecture"),
    ],
)
def test_command_errors_are_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_sigterm_stops_the_serve_command():
    """SIGTERM to `hybridlm serve` while a reply streams: the reply ends with an error event and [DONE], the
    server shuts down (uvicorn then raises SIGTERM again, with its default action)."""
    sock = _bound_socket()
    port = sock.getsockname()[1]
    sock.close()  # the server binds it again (another process taking it meanwhile is unlikely)
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridlm", "serve", "--port", str(port), "--max-context", "1024"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}/v1"
    body = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": LONG,
        "temperature": 0,
        "stream": True,
    }
    try:
        deadline = time.monotonic() + 180  # a guard against a hang, not a timing
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/models", timeout=5).status_code == 200:
                    break
            time.sleep(0.1)
        with httpx.stream("POST", url + "/completions", json=body, timeout=300) as r:
            lines = r.iter_lines()
            while '"text":""' in (line := next(lines)) or not line:  # until the reply decodes
                pass
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rest[-1] == "data: [DONE]" and "shutting down" in rest[-2], rest[-2:]
    assert proc.returncode == -signal.SIGTERM and "Finished server process" in err, err


def test_batched_server_decodes_concurrent_clients_together(tiny_model):
    """`Chat(batch_decode=True)`, as `hybridlm serve` makes it: concurrent greedy clients get the replies they
    get alone, from shared decode blocks; a streaming client that leaves mid-reply frees its batch row."""
    chat = RecordingChat(tiny_model, Tokenizer(), chunk_size=64, max_context=CONTEXT, batch_decode=True)
    topics = ["rivers", "the moon", "bread", "prime numbers"]
    config = uvicorn.Config(create_app(chat, MODEL), log_level="warning")
    with _serving(uvicorn.Server(config)) as (url, _):

        def ask(i: int) -> str:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
            messages = [{"role": "user", "content": f"Tell me about {topics[i]}."}]
            settings = dict(model=MODEL, messages=messages, max_tokens=40 + i, temperature=0)
            if i % 2:
                chunks = client.chat.completions.create(**settings, stream=True)
                return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            return client.chat.completions.create(**settings).choices[0].message.content

        alone = [ask(i) for i in range(4)]
        assert chat.batcher.peak_rows == 1
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(ask, range(4)))
        assert together == alone and len(set(alone)) == 4
        assert chat.batcher.peak_rows >= 2  # 4 replies of 3 blocks each, prefilled in under a block each

        body = {"model": MODEL, "messages": [USER], "max_tokens": LONG, "temperature": 0, "stream": True}
        before = len(chat.replies)
        endpoint = url + "/v1/chat/completions"
        with httpx.Client(timeout=300) as http, http.stream("POST", endpoint, json=body) as r:
            lines, contents = r.iter_lines(), 0
            while contents < 3:
                contents += bool(_content(next(lines)))
        assert ask(0) == alone[0]  # answered while (or after) the left reply's row is dropped
        deadline = time.monotonic() + 120
        while chat.batcher.rows() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert chat.batcher.rows() == 0
        left = chat.replies[before]
        assert left.stats.finish_reason is None and 3 <= left.stats.completion_tokens < LONG


def test_serve_clients_benchmark_runs():
    """`python -m benchmarks.serve_clients` at toy size: well-formed figures, no failed response."""
    from benchmarks import serve_clients

    records = serve_clients.main(
        ["--preset", "tiny", "--clients", "1", "2", "--seconds", "2", "--max-tokens", "6"]
    )
    assert [r["clients"] for r in records] == [1, 2]
    for r in records:
        assert r["requests"] >= 1 and r["completion_tokens"] >= r["requests"] and r["tokens_per_s"] > 0
