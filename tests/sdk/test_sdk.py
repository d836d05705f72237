"""The official OpenAI and Anthropic Python SDKs against the router, in front of two
simulated vLLM engines (fixtures in conftest.py). What a user of either SDK does:
chat (plain and streamed with usage), completions, model listing, Anthropic
messages.create and messages.stream, and the errors they raise; plus the router's
own view of the engines' reported cache use in /metrics.
"""

import re
import urllib.request

import anthropic
import openai
import pytest

MODEL = "m"  # the sim-engine's served model id

# (prompt tokens, cached tokens) of every response whose usage the SDK returned, for
# the last test to compare with the router's /metrics.
SEEN: dict[str, tuple[int, int]] = {}


def long_prompt(salt: str, words: int = 400) -> str:
    """A prompt of `words` words, distinct per `salt` (so tests don't share a cache)."""
    return " ".join(f"{salt}{i}" for i in range(words))


@pytest.fixture(scope="module")
def oai(stack):
    return openai.OpenAI(base_url=stack["router"] + "/v1", api_key="x", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def claude(stack):
    return anthropic.Anthropic(base_url=stack["router"], api_key="x", max_retries=0, timeout=30)


def test_models_list(oai):
    ids = [m.id for m in oai.models.list()]
    assert ids == [MODEL]


def test_chat_repeated_long_prompt_is_served_from_the_cache(oai):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": long_prompt("chat")},
    ]
    first = oai.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=6)
    second = oai.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=6)
    a, b = first.parse(), second.parse()
    assert a.choices[0].message.role == "assistant"
    assert len(a.choices[0].message.content.split()) == 6
    assert a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 6
    assert a.usage.prompt_tokens > 400
    # Cache-aware routing sends the repeat to the replica that holds the prefix.
    assert first.headers["x-sim-engine"] == second.headers["x-sim-engine"]
    cached = b.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < b.usage.prompt_tokens, b.usage
    SEEN["chat1"] = (a.usage.prompt_tokens, a.usage.prompt_tokens_details.cached_tokens)
    SEEN["chat2"] = (b.usage.prompt_tokens, cached)


def test_chat_stream_with_usage(oai):
    messages = [{"role": "user", "content": long_prompt("stream")}]
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 8
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 8
    assert last.usage.prompt_tokens > 400
    assert last.usage.prompt_tokens_details.cached_tokens == 0  # first time this prompt is seen
    # Content chunks only carry usage in the final chunk.
    assert all(c.usage is None for c in chunks[:-1])
    SEEN["stream"] = (last.usage.prompt_tokens, 0)


def test_completions(oai):
    prompt = long_prompt("cmpl", 50)
    out = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert out.object == "text_completion"
    assert len(out.choices[0].text.split()) == 4
    assert out.usage.prompt_tokens == 50
    SEEN["cmpl"] = (50, out.usage.prompt_tokens_details.cached_tokens)
    streamed = list(oai.completions.create(model=MODEL, prompt=prompt, max_tokens=3, stream=True))
    assert len("".join(c.choices[0].text for c in streamed).split()) == 3


def test_openai_error_is_raised_not_swallowed(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=[], max_tokens=1)
    assert err.value.status_code == 400


def test_anthropic_messages_create_reads_the_cache_on_repeat(claude):
    kwargs = dict(
        model=MODEL,
        max_tokens=5,
        system="You are terse.",
        messages=[{"role": "user", "content": long_prompt("claude")}],
    )
    first = claude.messages.create(**kwargs)
    assert first.type == "message" and first.role == "assistant"
    assert first.content[0].type == "text"
    assert len(first.content[0].text.split()) == 5
    assert first.stop_reason == "max_tokens"
    assert first.usage.output_tokens == 5
    assert first.usage.input_tokens > 400
    assert first.usage.cache_read_input_tokens == 0
    second = claude.messages.create(**kwargs)
    read = second.usage.cache_read_input_tokens
    assert read > 0
    assert second.usage.input_tokens + read == first.usage.input_tokens
    SEEN["claude1"] = (first.usage.input_tokens, 0)
    SEEN["claude2"] = (first.usage.input_tokens, read)


def test_anthropic_messages_stream(claude):
    with claude.messages.stream(
        model=MODEL,
        max_tokens=7,
        system=[{"type": "text", "text": "You are terse."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": long_prompt("cstream")}]}],
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) == 7
    assert "".join(pieces) == final.content[0].text
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 7
    assert final.usage.input_tokens > 400
    SEEN["cstream"] = (final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0), 0)


def test_anthropic_error_is_raised_not_swallowed(claude):
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=1, messages=[])
    assert err.value.status_code == 400


def test_streams_cut_mid_answer_are_read_whole_through_both_sdks(dying_stack):
    """A worker that dies mid-stream: the router continues the answer on the other one
    and each SDK reads one whole, well-formed answer."""
    url = dying_stack["router"]
    oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": long_prompt("cut", 50)}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) == 8
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].usage.completion_tokens == 8
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=30)
    with claude.messages.stream(
        model=MODEL,
        max_tokens=8,
        messages=[{"role": "user", "content": long_prompt("cutc", 50)}],
    ) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert len(pieces) == 8
    assert "".join(pieces) == final.content[0].text
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    continued = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("cache_aware_router_stream_migrations_total{") and 'outcome="continued"' in line
    )
    assert continued == 2, text


def test_router_metrics_match_what_the_clients_saw(stack):
    # Runs last (file order). The router reads usage from the responses as they pass
    # (JSON, the final OpenAI SSE chunk, Anthropic's message_start): its totals must
    # equal what the SDKs returned. The streamed completions above asked for no usage,
    # so neither side saw theirs.
    if len(SEEN) != 7:
        pytest.skip("needs the whole file to run first")
    with urllib.request.urlopen(stack["router"] + "/metrics", timeout=5) as r:
        text = r.read().decode()

    def total(family: str) -> int:
        pattern = rf"^cache_aware_router_{family}(?:{{[^}}]*}})? (\S+)$"
        return int(sum(float(v) for v in re.findall(pattern, text, re.M)))

    assert total("engine_prompt_tokens_total") == sum(p for p, _ in SEEN.values()), (SEEN, text)
    assert total("engine_cached_tokens_total") == sum(c for _, c in SEEN.values()), (SEEN, text)
    assert total("engine_cached_tokens_total") > 0
    for endpoint in ("chat_completions", "completions", "messages"):
        assert re.search(rf'^cache_aware_router_requests_total{{[^}}]*endpoint="{endpoint}"', text, re.M), endpoint
