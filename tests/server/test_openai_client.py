"""Drives `kvstream serve` with the official `openai` Python client.

Run by .ci/run after `cargo build`:  python tests/server/test_openai_client.py PATH/TO/kvstream
Starts the server on loopback with the tiny fixture model, checks chat and completions, streaming
and not, the error shapes, and that a follow-up turn reports cached prompt tokens and produces
exactly the tokens a fresh request would. Exits non-zero on the first failure.
"""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import openai

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = os.path.join(ROOT, "fixtures", "tiny-gqa-f32")
passed = 0
failed = 0


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def check(name, cond, detail=""):
    global passed, failed
    if cond:
        passed += 1
        print(f"ok   {name}")
    else:
        failed += 1
        print(f"FAIL {name} {detail}")


def main():
    binary = sys.argv[1]
    port = free_port()
    proc = subprocess.Popen(
        [binary, "serve", "--model", MODEL, "--host", "127.0.0.1", "--port", str(port),
         "--kv-arena", "8MiB", "--kv-page-tokens", "16", "--queue", "2", "--ctx-size", "1024"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            if time.time() > deadline or proc.poll() is not None:
                raise SystemExit("server did not become healthy: " + proc.stderr.read().decode()[-2000:])
            time.sleep(0.2)
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)

        models = client.models.list()
        check("models lists the served model", len(models.data) == 1 and models.data[0].id == "tiny-gqa-f32")

        msgs = [{"role": "user", "content": "Tell me a story."}]
        r = client.chat.completions.create(model="x", messages=msgs, max_tokens=12, temperature=0)
        check("chat non-streaming returns text", isinstance(r.choices[0].message.content, str))
        check("chat usage counts tokens", r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0,
              str(r.usage))
        check("chat finish_reason", r.choices[0].finish_reason in ("stop", "length"))

        pieces = []
        finish = None
        usage = None
        stream = client.chat.completions.create(model="x", messages=msgs, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                if c.delta.content:
                    pieces.append(c.delta.content)
                if c.finish_reason:
                    finish = c.finish_reason
        check("chat streaming equals non-streaming text", "".join(pieces) == r.choices[0].message.content,
              repr(("".join(pieces), r.choices[0].message.content)))
        check("chat streaming finish + usage", finish is not None and usage is not None
              and usage.completion_tokens == r.usage.completion_tokens)

        # Follow-up turn: cached prompt tokens, same tokens as a fresh request.
        follow = msgs + [{"role": "assistant", "content": r.choices[0].message.content},
                         {"role": "user", "content": "And then?"}]
        f1 = client.chat.completions.create(model="x", messages=follow, max_tokens=10, temperature=0)
        details = getattr(f1.usage, "prompt_tokens_details", None)
        cached = getattr(details, "cached_tokens", 0) if details else 0
        check("follow-up reports cached prompt tokens", cached > 0, str(f1.usage))
        # A different conversation in between evicts the cache; then the same follow-up fresh.
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "zzz"}], max_tokens=2,
                                       temperature=0)
        f2 = client.chat.completions.create(model="x", messages=follow, max_tokens=10, temperature=0)
        check("cached follow-up equals a fresh request", f1.choices[0].message.content == f2.choices[0].message.content,
              repr((f1.choices[0].message.content, f2.choices[0].message.content)))

        c = client.completions.create(model="x", prompt="Once upon a time", max_tokens=8, temperature=0)
        check("completion non-streaming", isinstance(c.choices[0].text, str) and c.usage.completion_tokens > 0)
        text = "".join(ch.choices[0].text for ch in client.completions.create(
            model="x", prompt="Once upon a time", max_tokens=8, temperature=0, stream=True) if ch.choices)
        check("completion streaming equals non-streaming", text == c.choices[0].text, repr((text, c.choices[0].text)))

        # Error shapes.
        for name, kwargs, param in [
            ("max_tokens <= 0", dict(max_tokens=0), "max_tokens"),
            ("n > 1", dict(n=2, max_tokens=2), "n"),
        ]:
            try:
                client.chat.completions.create(model="x", messages=msgs, **kwargs)
                check(f"error {name}", False, "no error raised")
            except openai.BadRequestError as e:
                body = e.body if isinstance(e.body, dict) else {}
                check(f"error {name} is a 400 with OpenAI shape",
                      e.status_code == 400 and body.get("param") == param and "message" in body, str(e.body))
        try:
            client.chat.completions.create(model="x", messages=[{"role": "user", "content": "word " * 2000}],
                                           max_tokens=2)
            check("over-long prompt", False, "no error raised")
        except openai.BadRequestError as e:
            check("over-long prompt is a 400", e.status_code == 400 and "context" in str(e.body))
        req = urllib.request.Request(base + "/v1/chat/completions", data=b"{not json", method="POST",
                                     headers={"content-type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=10)
            check("malformed json", False)
        except urllib.error.HTTPError as e:
            body = json.loads(e.read())
            check("malformed JSON is a 400 with an error object", e.code == 400 and "error" in body)
        with urllib.request.urlopen(base + "/health", timeout=5) as h:
            check("server still healthy after bad input", h.status == 200)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
