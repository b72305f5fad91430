"""vLLM's native RL route through ``OpenAIInference(server="vllm")``, against a running
server, with the figures printed.

    python tools/vllm/native_probe.py --base-url http://127.0.0.1:8000/v1 [--model NAME]

The server: vLLM 0.32 started with ``VLLM_SERVER_DEV_MODE=1`` (``/pause``, ``/resume``,
``/update_weight_version``), with ``--enable-scale-out`` for the native route (without it
the checks show the fallback instead). What is checked, each from the server's own
account where it gives one:

- **shapes**: one raw native generate, its request and reply JSON (abridged), the request
  id as vLLM rewrites it, the weight version a label gives its tokens, that a label is
  accepted while paused, that unknown ``sampling_params`` keys are ignored, and that
  ``abort_requests`` aborts by the rewritten id and not by the id sent;
- **native**: an id prompt, a chat prompt and a completions prompt through the interface:
  token ids, text, logprobs, ``policy_epoch``;
- **keep**: a long call (``ignore_eos``, 300 tokens) paused mid-way with ``keep`` and
  resumed under epoch 1: its ``policy_epoch`` has a boundary inside the generated ids,
  epochs 0 then 1;
- **abort**: the same with ``abort``: the call is continued and merged (300 tokens, one
  logprob each, epochs 0 then 1);
- **cancel**: a call cancelled mid-way: the server stops generating at once
  (``vllm:generation_tokens_total`` stops moving well before the tokens asked);
- **probe**: :meth:`OpenAIInference.probe` (``raw`` on vLLM's default, ``processed`` with
  ``--logprobs-mode processed_logprobs``).

Exits non-zero with the first failed check. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any

import httpx2
import trio

from trio_rollouts import ChatMessage, GenerationArgs
from trio_rollouts.inference import InferenceRequest, InferenceResponse, OpenAIInference
from trio_rollouts.inference.openai._control import control_root

#: Tokens of the long calls (the tiny model makes about 600 a second on 2 cores).
LONG = 300
#: Tokens of the raw long requests (the model's context is 1024).
LONG_RAW = 900
#: Delays after which a pause is tried, until one lands inside a long call.
DELAYS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)
#: Bound on each check, seconds.
CHECK_TIMEOUT = 120.0


class CheckFailed(Exception):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def show(title: str, value: Any) -> None:
    text = value if isinstance(value, str) else json.dumps(value, indent=None, default=str)
    print(f"  {title}: {text}", flush=True)


def abridged(data: Any, keep: int = 4) -> Any:
    """``data`` with every list cut to ``keep`` items (the rest counted)."""
    if isinstance(data, list):
        head = [abridged(item, keep) for item in data[:keep]]
        return head + ([f"... {len(data) - keep} more"] if len(data) > keep else [])
    if isinstance(data, dict):
        return {key: abridged(value, keep) for key, value in data.items()}
    return data


class Server:
    """Direct HTTP to the server, for what the interface does not show."""

    def __init__(self, base_url: str, model: str) -> None:
        self.root = control_root(base_url)
        self.model = model
        self.client = httpx2.AsyncClient(timeout=60.0)

    async def post(self, path: str, body: dict[str, Any] | None = None) -> httpx2.Response:
        return await self.client.post(self.root + path, json=body)

    async def metric(self, name: str) -> float:
        text = (await self.client.get(self.root + "/metrics")).text
        pattern = rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$"
        return sum(float(m.group(2)) for m in re.finditer(pattern, text, re.MULTILINE))

    async def generate(self, request_id: str, max_tokens: int, **params: Any) -> dict[str, Any]:
        body = {
            "request_id": request_id,
            "model": self.model,
            "token_ids": [72, 101, 108, 108, 111],
            "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True, **params},
            "return_token_ids": True,
            "output_mode": "text",
        }
        response = await self.post("/inference/v1/generate", body)
        check(response.status_code == 200, f"native generate: {response.status_code}")
        data: dict[str, Any] = response.json()
        return data


def ask(text: str, **args: Any) -> InferenceRequest:
    return InferenceRequest(
        prompt=[ChatMessage(role="user", content=text)], generation_args=GenerationArgs(**args)
    )


def long_call(max_tokens: int = LONG) -> InferenceRequest:
    """An id prompt that generates ``max_tokens`` (the interface sends ``ignore_eos``)."""
    return InferenceRequest(
        prompt=[],
        prompt_ids=[72, 101, 108, 108, 111],
        generation_args=GenerationArgs(max_tokens=max_tokens, temperature=1.0),
    )


def summary(response: InferenceResponse) -> dict[str, Any]:
    ids = response.token_ids or []
    prompt = response.prompt_length or 0
    return {
        "prompt_ids": len(ids[:prompt]),
        "generated": len(ids) - prompt,
        "logprobs": None if response.logprobs is None else len(response.logprobs),
        "content": response.response.content[:24],
        "finish_reason": response.finish_reason,
        "policy_epoch": response.policy_epoch,
        "logprobs_mode": response.logprobs_mode,
    }


# --------------------------------------------------------------------------- checks


async def check_shapes(server: Server) -> bool:
    """The raw route: returns whether the server serves it."""
    print("shapes", flush=True)
    probe = await server.post(
        "/inference/v1/generate",
        {"request_id": "probe", "token_ids": [72], "sampling_params": {"max_tokens": 1}},
    )
    if probe.status_code != 200:
        show("native route", f"{probe.status_code} {probe.text[:160]}")
        return False
    body = {
        "request_id": "shape-1",
        "model": server.model,
        "token_ids": [72, 101, 108],
        "sampling_params": {"max_tokens": 4, "seed": 3, "logprobs": 1, "no_such_key": 7},
        "return_token_ids": True,
        "output_mode": "text",
    }
    show("request", body)
    reply = await server.post("/inference/v1/generate", body)
    data = reply.json()
    show("reply", abridged(data, keep=2))
    check(data["request_id"] == "generate-tokens-shape-1", f"request id {data['request_id']!r}")
    show("rewritten request id", data["request_id"])
    show("unknown sampling_params key", "ignored (200)")
    label = await server.post("/update_weight_version", {"new_version": "shape-label"})
    show("update_weight_version", f"{label.status_code} {label.text}")
    labelled = await server.generate("shape-2", 2)
    versions = labelled["choices"][0]["weight_versions"]
    show("weight_versions after it", versions)
    check(versions[0]["version"] == "shape-label", "the label did not reach the tokens")
    paused = await server.post("/pause?mode=keep&clear_cache=false")
    while_paused = await server.post("/update_weight_version", {"new_version": "shape-paused"})
    await server.post("/resume")
    show("pause, label while paused", f"{paused.status_code}, {while_paused.status_code}")
    check(while_paused.status_code == 200, "a label was refused while paused")
    for rewritten, name in ((False, "the id as sent"), (True, "the rewritten id")):
        for attempt, delay in enumerate(DELAYS):
            request_id = f"shape-abort-{int(rewritten)}-{attempt}"
            target = f"generate-tokens-{request_id}" if rewritten else request_id
            choice, landed = await aborted_while_paused(server, request_id, target, delay)
            if landed:
                break
            show(f"the pause after {delay} s did not land inside", choice["weight_versions"])
        show(
            f"abort_requests with {name} (sent while the request was frozen)",
            f"finish_reason {choice['finish_reason']!r} after {len(choice['token_ids'])} of "
            f"{LONG_RAW} tokens, weight_versions {choice['weight_versions']}",
        )
        check(landed, "no pause landed inside the request")
        aborted = choice["finish_reason"] == "abort"
        check(aborted == rewritten, f"abort_requests with {name}: {choice['finish_reason']}")
    return True


async def aborted_while_paused(
    server: Server, request_id: str, target: str, delay: float
) -> tuple[dict[str, Any], bool]:
    """A long raw request, paused (``keep``) ``delay`` s after it is sent, labelled
    ``frozen-<id>`` while paused, ``abort_requests`` for ``target`` sent while it is
    frozen, then resumed: its choice, and whether the pause landed before its end (a
    fixed sleep cannot be trusted on 2 cores shared with the server: the caller tries
    longer delays)."""
    result: dict[str, Any] = {}
    label = f"frozen-{request_id}"
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            result.update(await server.generate(request_id, LONG_RAW))

        nursery.start_soon(run)
        await trio.sleep(delay)
        await server.post("/pause?mode=keep&clear_cache=false")
        await server.post("/update_weight_version", {"new_version": label})
        answer = await server.post("/inference/v1/abort_requests", {"request_ids": [target]})
        check(answer.status_code == 200, f"abort_requests: {answer.status_code}")
        await trio.sleep(0.5)  # vLLM aborts in a background task
        await server.post("/resume")
    choice: dict[str, Any] = result["choices"][0]
    versions = [span["version"] for span in choice["weight_versions"] or []]
    return choice, choice["finish_reason"] == "abort" or label in versions


async def check_native(interface: OpenAIInference, native: bool) -> None:
    print("native", flush=True)
    token_in = await interface.agenerate(
        InferenceRequest(
            prompt=[], prompt_ids=[72, 101, 108], generation_args=GenerationArgs(max_tokens=8)
        )
    )
    show("id prompt", summary(token_in))
    chat = await interface.agenerate(ask("Hi there", max_tokens=8))
    show("chat prompt", summary(chat))
    completions = OpenAIInference(
        interface.base_url, interface.model, server="vllm", endpoint="completions"
    )
    text = await completions.agenerate(ask("Hi there", max_tokens=8))
    show("completions prompt", summary(text))
    for response in (token_in, chat, text):
        generated = len(response.token_ids or []) - (response.prompt_length or 0)
        check(response.token_ids is not None and generated >= 1, "no token ids")
        check(response.logprobs is not None and len(response.logprobs) == generated, "logprobs")
    show("stamps_policy_epoch", interface.stamps_policy_epoch)
    check(interface.stamps_policy_epoch == native, "stamps_policy_epoch")
    # The same seeded request on the native route and on the OpenAI routes: the same ids,
    # text, logprobs and usage (the chat template and the tokenizer are the server's).
    for endpoint in ("chat", "completions"):
        routes = [
            OpenAIInference(interface.base_url, interface.model, server=server, endpoint=endpoint)
            for server in ("vllm", None)
        ]
        request = InferenceRequest(
            prompt=[
                ChatMessage(role="system", content="Be brief."),
                ChatMessage(role="user", content="Hello there"),
            ],
            generation_args=GenerationArgs(max_tokens=12, temperature=1.0, seed=7),
        )
        on_native, on_openai = [await route.agenerate(request) for route in routes]
        same = (
            on_native.token_ids == on_openai.token_ids
            and on_native.response.content == on_openai.response.content
            and on_native.raw_text == on_openai.raw_text
            and on_native.logprobs == on_openai.logprobs
        )
        show(f"{endpoint}: native and OpenAI route agree (seed 7)", same)
        check(same, f"{endpoint}: the native route differs from the OpenAI route")


async def paused_call(
    interface: OpenAIInference, mode: str, epoch: int, delay: float, tokens: int
) -> InferenceResponse:
    """A long call paused in ``mode`` ``delay`` s after it starts, resumed under
    ``epoch`` (the pause may land before its first token or after its end: the caller
    tries other delays)."""
    result: list[InferenceResponse] = []
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            result.append(await interface.agenerate(long_call(tokens)))

        nursery.start_soon(run)
        await trio.sleep(delay)
        await interface.pause(mode)  # type: ignore[arg-type]
        await trio.sleep(0.2)
        await interface.resume(epoch)
    return result[0]


async def check_keep_and_abort(interface: OpenAIInference, native: bool) -> None:
    epoch = 0
    for mode in ("keep", "abort"):
        print(mode, flush=True)
        # 300 tokens first, as asked; 900 when the machine is too busy for a pause to land
        # inside 300 (another process on the 2 cores delays every request).
        tries = [(tokens, delay) for tokens in (LONG, LONG_RAW) for delay in DELAYS]
        for tokens, delay in tries:
            epoch += 1
            response = await paused_call(interface, mode, epoch, delay, tokens)
            if not native or len(response.policy_epoch) > 1:
                break
            show(f"the pause after {delay} s did not land inside", response.policy_epoch)
        info = summary(response)
        show("call", info)
        check(info["generated"] == tokens, f"{mode}: {info['generated']} tokens, not {tokens}")
        check(info["logprobs"] == tokens, f"{mode}: {info['logprobs']} logprobs")
        if native:
            epochs = [e for _, e in response.policy_epoch]
            starts = [s for s, _ in response.policy_epoch]
            check(epochs == [epoch - 1, epoch], f"{mode}: epochs {epochs}")
            check(0 < starts[1] < tokens, f"{mode}: boundary {starts[1]} not inside")
            show("boundary", f"token {starts[1]} of {tokens}, epochs {epochs}")


async def check_cancel(interface: OpenAIInference, server: Server) -> None:
    """A call frozen mid-way by a keep pause of the server (not of the interface: its
    calls would be held), cancelled, then the server resumed: it must not generate the
    rest."""
    print("cancel", flush=True)
    asked = LONG_RAW
    for delay in DELAYS:
        before = await server.metric("vllm:generation_tokens_total")
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()

            async def run(scope: trio.CancelScope = scope) -> None:
                with scope:
                    await interface.agenerate(long_call(asked))

            nursery.start_soon(run)
            await trio.sleep(delay)
            await server.post("/pause?mode=keep&clear_cache=false")
            frozen = await server.metric("vllm:generation_tokens_total")
            scope.cancel()
        cancelled = time.monotonic()
        await trio.sleep(0.5)  # the abort, from a system task, and vLLM's background abort
        await server.post("/resume")
        await trio.sleep(1.0)
        settled = await server.metric("vllm:generation_tokens_total")
        if 0 < frozen - before < asked:
            break
        show(f"the pause after {delay} s did not land inside", f"{frozen - before:.0f} tokens")
    show(
        "cancelled mid-way",
        f"{frozen - before:.0f} tokens of {asked} when frozen, {settled - frozen:.0f} more "
        f"after the cancel and resume ({time.monotonic() - cancelled:.1f} s later)",
    )
    check(0 < frozen - before < asked, "no pause landed inside the call")
    check(settled == frozen, "the server went on generating the cancelled call")


async def check_probe(interface: OpenAIInference) -> None:
    print("probe", flush=True)
    for probe in await interface.probe():
        show("probe", f"{probe}")
    response = await interface.agenerate(ask("Hi", max_tokens=2))
    show("logprobs_mode of a call", response.logprobs_mode)


async def main(base_url: str, model: str | None) -> None:
    async with httpx2.AsyncClient(timeout=30.0) as client:
        if model is None:
            listed = (await client.get(base_url.rstrip("/") + "/models")).json()
            model = str(listed["data"][0]["id"])
    server = Server(base_url, model)
    with trio.fail_after(CHECK_TIMEOUT * 6):
        native = await check_shapes(server)
        # ignore_eos: the tiny model stops on every 8th byte; the long calls must not.
        interface = OpenAIInference(base_url, model, server="vllm", extra_body={"ignore_eos": True})
        await check_probe(interface)
        await check_native(interface, native)
        await check_keep_and_abort(interface, native)
        await check_cancel(interface, server)
    await server.client.aclose()
    print("all native checks passed" if native else "fallback checks passed (no native route)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="the API root, such as .../v1")
    parser.add_argument("--model", default=None, help="the served model (default: the first)")
    args = parser.parse_args()
    try:
        trio.run(main, args.base_url, args.model)
    except CheckFailed as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        sys.exit(1)
