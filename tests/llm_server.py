"""A local model server for tests: the wire protocols of OpenAI (Chat Completions and Responses),
Ollama (``/api/chat``) and Anthropic (Messages), plain and streamed, playing scripted replies.

The real provider SDKs (``openai``, ``ollama``, ``anthropic``) and MAF's provider clients on them talk
to it exactly as to the hosted service, so every instrumentation of those SDKs sees real calls. A
test scripts the replies per model name (each agent its own model, so concurrent agents never take
each other's replies): ``server.script("writer", [Reply(120, 40)])``. A reply's finish is given in
OpenAI Chat Completions' words and sent in each protocol's own (:data:`FINISH`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass(frozen=True)
class Reply:
    """One model response. ``tool_call``: the model asks for that tool (with ``arguments``) instead of
    answering ``text``; ``usage=False``: no usage at all (a stream then ends without its usage chunk);
    ``cached``/``reasoning``: the parts of the input/output tokens served from the prompt cache / spent
    on reasoning (the GenAI conventions' input includes cached input, output includes reasoning)."""

    input_tokens: int
    output_tokens: int
    finish: str = "stop"  # stop | length | tool_calls | content_filter
    text: str = "ok"
    tool_call: str | None = None
    arguments: Mapping[str, Any] = field(default_factory=lambda: {"query": "x"})
    usage: bool = True
    cached: int = 0
    reasoning: int = 0
    cache_creation: int = 0  # Anthropic only: input tokens written to the cache

    @property
    def total(self) -> int:
        return self.input_tokens + self.output_tokens


def calls(name: str, *replies: Reply) -> list[Reply]:
    """A tool loop: ``replies[0]`` asks for tool ``name``, the rest answer (finish given per reply)."""
    first, *rest = replies
    return [Reply(first.input_tokens, first.output_tokens, "tool_calls", tool_call=name,
                  cached=first.cached, reasoning=first.reasoning, usage=first.usage), *rest]


#: A reply's finish (OpenAI Chat Completions) in each protocol: Responses API (status, incomplete
#: reason), Ollama ``done_reason``, Anthropic ``stop_reason``.
FINISH: dict[str, dict[str, Any]] = {
    "stop": {"responses": ("completed", None), "ollama": "stop", "anthropic": "end_turn"},
    "tool_calls": {"responses": ("completed", None), "ollama": "stop", "anthropic": "tool_use"},
    "length": {"responses": ("incomplete", "max_output_tokens"), "ollama": "length", "anthropic": "max_tokens"},
    "content_filter": {"responses": ("incomplete", "content_filter"), "ollama": "stop", "anthropic": "refusal"},
}


class LLMServer:
    """The server on 127.0.0.1 (a port chosen at run time), in a thread of its own with its own event
    loop, so a test's ``asyncio.run`` can call it. ``requests``: every request body received, in order,
    with its ``_path``."""

    def __init__(self) -> None:
        self._scripts: dict[str, deque[Reply]] = defaultdict(deque)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.requests: list[dict[str, Any]] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="llm-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(15):
            raise RuntimeError("the test model server did not start")

    # --- scripting -------------------------------------------------------------------------------

    def script(self, model: str, replies: Iterable[Reply]) -> None:
        """Queue ``replies`` for ``model`` (after any still queued)."""
        with self._lock:
            self._scripts[model.lower()].extend(replies)

    def reset(self) -> None:
        with self._lock:
            self._scripts.clear()
            self.requests.clear()

    def unplayed(self) -> dict[str, int]:
        """Replies scripted but never asked for, per model (a test's script and its run disagree)."""
        with self._lock:
            return {model: len(queue) for model, queue in self._scripts.items() if queue}

    def _next(self, path: str, body: dict[str, Any]) -> tuple[str, Reply]:
        model = str(body.get("model") or "")
        with self._lock:
            self.requests.append({"_path": path, **body})
            queue = self._scripts.get(model.lower())
            if not queue:
                raise web.HTTPBadRequest(text=json.dumps({"error": {"message": f"no reply scripted for {model!r}"}}),
                                         content_type="application/json")
            return model, queue.popleft()

    # --- serving ---------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_post("/api/chat", self._ollama_chat)
        app.router.add_post("/v1/messages", self._anthropic_messages)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        async def stop() -> None:
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _id(self, prefix: str) -> str:
        return f"{prefix}_{next(self._ids)}"

    @staticmethod
    async def _sse(request: web.Request, events: Iterable[tuple[str | None, Any]]) -> web.StreamResponse:
        """Server-sent events: (event name or None, data: a JSON-able value or a raw string)."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for event, data in events:
            text = data if isinstance(data, str) else json.dumps(data)
            await response.write(((f"event: {event}\n" if event else "") + f"data: {text}\n\n").encode())
        await response.write_eof()
        return response

    # --- OpenAI Chat Completions -----------------------------------------------------------------

    @staticmethod
    def _chat_usage(reply: Reply) -> dict[str, Any]:
        return {"prompt_tokens": reply.input_tokens, "completion_tokens": reply.output_tokens,
                "total_tokens": reply.total,
                "prompt_tokens_details": {"cached_tokens": reply.cached},
                "completion_tokens_details": {"reasoning_tokens": reply.reasoning}}

    def _tool_call_id(self, reply: Reply) -> str:
        return f"call_{reply.tool_call}_{next(self._ids)}"

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        model, reply = self._next(request.path, body)
        cid, created = self._id("chatcmpl"), int(time.time())
        tool_calls = ([{"id": self._tool_call_id(reply), "type": "function",
                        "function": {"name": reply.tool_call, "arguments": json.dumps(dict(reply.arguments))}}]
                      if reply.tool_call else None)
        if not body.get("stream"):
            message = {"role": "assistant", "content": None if tool_calls else reply.text, "refusal": None}
            if tool_calls:
                message["tool_calls"] = tool_calls
            return web.json_response({
                "id": cid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": reply.finish, "logprobs": None}],
                **({"usage": self._chat_usage(reply)} if reply.usage else {})})

        def chunk(choices: list, **extra: Any) -> tuple[None, dict]:
            return None, {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                          "choices": choices, **extra}

        if tool_calls:
            delta = {"role": "assistant", "content": None,
                     "tool_calls": [{"index": 0, **tool_calls[0]}]}
        else:
            delta = {"role": "assistant", "content": reply.text}
        events = [chunk([{"index": 0, "delta": delta, "finish_reason": None}]),
                  chunk([{"index": 0, "delta": {}, "finish_reason": reply.finish}])]
        if reply.usage and (body.get("stream_options") or {}).get("include_usage"):
            events.append(chunk([], usage=self._chat_usage(reply)))
        events.append((None, "[DONE]"))
        return await self._sse(request, events)

    # --- OpenAI Responses ------------------------------------------------------------------------

    def _response_object(self, model: str, reply: Reply, rid: str, *, final: bool) -> dict[str, Any]:
        status, incomplete = FINISH[reply.finish]["responses"]
        if reply.tool_call:
            output = [{"type": "function_call", "id": self._id("fc"), "call_id": self._tool_call_id(reply),
                       "name": reply.tool_call, "arguments": json.dumps(dict(reply.arguments)),
                       "status": "completed"}]
        else:
            output = [{"type": "message", "id": self._id("msg"), "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": reply.text, "annotations": []}]}]
        usage = ({"input_tokens": reply.input_tokens, "input_tokens_details": {"cached_tokens": reply.cached},
                  "output_tokens": reply.output_tokens,
                  "output_tokens_details": {"reasoning_tokens": reply.reasoning},
                  "total_tokens": reply.total} if reply.usage and final else None)
        return {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
                "status": status if final else "in_progress",
                "incomplete_details": {"reason": incomplete} if incomplete and final else None,
                "error": None, "output": output if final else [], "usage": usage,
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "temperature": None,
                "top_p": None, "metadata": {}, "instructions": None}

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        model, reply = self._next(request.path, body)
        rid = self._id("resp")
        final = self._response_object(model, reply, rid, final=True)
        if not body.get("stream"):
            return web.json_response(final)
        item = final["output"][0]
        seq = itertools.count()

        def event(kind: str, **data: Any) -> tuple[str, dict]:
            return kind, {"type": kind, "sequence_number": next(seq), **data}

        events = [event("response.created", response=self._response_object(model, reply, rid, final=False)),
                  event("response.output_item.added", output_index=0,
                        item={**item, "status": "in_progress",
                              **({"arguments": ""} if reply.tool_call else {"content": []})})]
        if reply.tool_call:
            events += [event("response.function_call_arguments.delta", item_id=item["id"], output_index=0,
                             delta=item["arguments"]),
                       event("response.function_call_arguments.done", item_id=item["id"], output_index=0,
                             arguments=item["arguments"])]
        else:
            events += [event("response.output_text.delta", item_id=item["id"], output_index=0, content_index=0,
                             delta=reply.text, logprobs=[]),
                       event("response.output_text.done", item_id=item["id"], output_index=0, content_index=0,
                             text=reply.text, logprobs=[])]
        events += [event("response.output_item.done", output_index=0, item=item),
                   event("response.completed" if final["status"] == "completed" else "response.incomplete",
                         response=final)]
        return await self._sse(request, events)

    # --- Ollama ----------------------------------------------------------------------------------

    async def _ollama_chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        model, reply = self._next(request.path, body)
        created = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
        message: dict[str, Any] = {"role": "assistant", "content": "" if reply.tool_call else reply.text}
        if reply.tool_call:
            message["tool_calls"] = [{"function": {"name": reply.tool_call, "arguments": dict(reply.arguments)}}]
        done: dict[str, Any] = {"model": model, "created_at": created, "done": True,
                                "done_reason": FINISH[reply.finish]["ollama"], "total_duration": 1000,
                                "load_duration": 10, "prompt_eval_duration": 100, "eval_duration": 800}
        if reply.usage:
            done |= {"prompt_eval_count": reply.input_tokens, "eval_count": reply.output_tokens}
        if not body.get("stream", True):
            return web.json_response({**done, "message": message})
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await response.prepare(request)
        lines = [{"model": model, "created_at": created, "message": message, "done": False},
                 {**done, "message": {"role": "assistant", "content": ""}}]
        for line in lines:
            await response.write((json.dumps(line) + "\n").encode())
        await response.write_eof()
        return response

    # --- Anthropic Messages ----------------------------------------------------------------------

    async def _anthropic_messages(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        model, reply = self._next(request.path, body)
        mid = self._id("msg")
        if reply.tool_call:
            block = {"type": "tool_use", "id": f"toolu_{next(self._ids)}", "name": reply.tool_call,
                     "input": dict(reply.arguments)}
        else:
            block = {"type": "text", "text": reply.text}
        # Anthropic's input_tokens are the uncached part; cache reads and writes are counted beside it.
        usage = {"input_tokens": reply.input_tokens - reply.cached - reply.cache_creation,
                 "output_tokens": reply.output_tokens, "cache_read_input_tokens": reply.cached,
                 "cache_creation_input_tokens": reply.cache_creation}
        stop_reason = FINISH[reply.finish]["anthropic"]
        message = {"id": mid, "type": "message", "role": "assistant", "model": model, "content": [block],
                   "stop_reason": stop_reason, "stop_sequence": None,
                   "usage": usage if reply.usage else {"input_tokens": 0, "output_tokens": 0}}
        if not body.get("stream"):
            return web.json_response(message)
        start_usage = {**usage, "output_tokens": 1} if reply.usage else {"input_tokens": 0, "output_tokens": 0}
        if reply.tool_call:
            start_block = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        else:
            start_block, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": reply.text}
        events = [
            ("message_start", {"type": "message_start",
                               "message": {**message, "content": [], "stop_reason": None, "usage": start_usage}}),
            ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": start_block}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                               "usage": {"output_tokens": reply.output_tokens if reply.usage else 0}}),
            ("message_stop", {"type": "message_stop"}),
        ]
        return await self._sse(request, events)

