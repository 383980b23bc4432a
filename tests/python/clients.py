"""The official OpenAI and Anthropic Python clients against `kvroute serve`
in front of `kvroute sim` (run by tests/apis.rs with the venv of
tests/python/install.sh): `clients.py openai|anthropic ROUTER_URL`.

Each check asserts; the last line printed is a JSON summary for the test.
The cached tokens of a conversation's second turn are the proof that the
router sent it where the first turn's cache (and stored response) is.
"""

import json
import sys

MODEL = "sim-model"


def long_text(seed):
    return ". ".join(f"client conversation {seed} line {i}" for i in range(60))


def openai_checks(base):
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    first = client.responses.create(model=MODEL, input=long_text(1), max_output_tokens=4)
    assert first.id and first.output_text, first
    second = client.responses.create(
        model=MODEL,
        input="And then?",
        previous_response_id=first.id,
        max_output_tokens=4,
    )
    second_cached = second.usage.input_tokens_details.cached_tokens

    stream = client.responses.create(
        model=MODEL, input=long_text(2), max_output_tokens=3, stream=True
    )
    kinds = []
    streamed_id = None
    for event in stream:
        kinds.append(event.type)
        if event.type == "response.completed":
            streamed_id = event.response.id
    assert kinds[0] == "response.created", kinds
    assert kinds[-1] == "response.completed", kinds
    assert "response.output_text.delta" in kinds, kinds
    after_stream = client.responses.create(
        model=MODEL,
        input="More.",
        previous_response_id=streamed_id,
        max_output_tokens=2,
    )

    retrieved = client.responses.retrieve(first.id)
    assert retrieved.id == first.id, retrieved
    client.responses.delete(first.id)
    try:
        client.responses.retrieve(first.id)
        raise AssertionError("a deleted response was retrieved")
    except openai.NotFoundError:
        pass
    try:
        client.responses.create(model=MODEL, input=3)
        raise AssertionError("a bad input was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400, e
    return {
        "second_turn_cached_tokens": second_cached,
        "after_stream_cached_tokens": after_stream.usage.input_tokens_details.cached_tokens,
    }


def anthropic_checks(base):
    import anthropic

    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
    turn = {"role": "user", "content": long_text(3)}
    first = client.messages.create(model=MODEL, max_tokens=4, messages=[turn])
    assert first.type == "message" and first.content[0].text, first
    said = first.content[0].text
    with client.messages.stream(
        model=MODEL,
        max_tokens=3,
        messages=[turn, {"role": "assistant", "content": said}, {"role": "user", "content": "Go on."}],
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.stop_reason, final
    count = client.messages.count_tokens(model=MODEL, messages=[turn])
    assert count.input_tokens > 100, count
    try:
        client.messages.create(
            model=MODEL,
            max_tokens=1,
            messages=[{"role": "user", "content": [{"type": "image"}]}],
        )
        raise AssertionError("an image without a source was accepted")
    except anthropic.BadRequestError as e:
        assert e.body["error"]["type"] == "invalid_request_error", e.body
    try:
        client.messages.create(
            model="no-such-model", max_tokens=1, messages=[{"role": "user", "content": "x"}]
        )
        raise AssertionError("an unknown model was accepted")
    except anthropic.NotFoundError as e:
        assert e.body["error"]["type"] == "not_found_error", e.body
    return {"second_turn_cached_tokens": final.usage.cache_read_input_tokens}


if __name__ == "__main__":
    which, base = sys.argv[1], sys.argv[2]
    checks = {"openai": openai_checks, "anthropic": anthropic_checks}[which]
    print(json.dumps(checks(base)))
