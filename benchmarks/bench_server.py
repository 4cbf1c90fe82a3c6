"""HTTP overhead of the OpenAI server: TTFT and TPOT through `POST /v1/completions` (streaming) at concurrency 1,
against the same numbers measured in-process (`python -m pegainfer bench`) on the same model folder.

    python benchmarks/bench_server.py --model-path DIR [--prompt-len 16] [--output-len 128] [--runs 5] [--json OUT]

TTFT = request sent on an open connection (connected beforehand, as keep-alive clients are) → first SSE chunk
carrying a token; TPOT = (last token chunk − first) / (completion tokens − 1),
with the token count from the final usage chunk. Uses only the standard library as the client. The floor is the
same client's TTFT against a bare asyncio server that answers at once (loopback TCP and waking an idle server and
client: what any out-of-process server costs on this host). ``bench_server_overhead.py`` is the CPU-only
counterpart (a fake engine with GPU-like step times).
"""
import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np


def with_word_tokenizer(folder: str) -> str:
    """A view of ``folder`` (weights and config symlinked) whose tokenizer maps every id of the embedding to a
    word ("w123 "), so a random-weight model's tokens all decode to text and every token becomes an SSE chunk
    (the server sends no chunk for a token whose text is empty or held back)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    src = os.path.abspath(folder)
    dst = tempfile.mkdtemp(prefix="pegainfer-bench-server-")
    for name in os.listdir(src):
        if not name.startswith("tokenizer") and name != "chat_template.jinja":
            os.symlink(os.path.join(src, name), os.path.join(dst, name))
    cfg = json.load(open(os.path.join(src, "config.json")))
    vocab_size = cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces
    tok.save(os.path.join(dst, "tokenizer.json"))
    return dst


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_once(port, prompt_ids, output_len):
    body = json.dumps({"prompt": prompt_ids, "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.connect()       # an open connection, as keep-alive clients (the openai SDK's httpx pool) have
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    first = last = None
    usage = None
    buf = b""
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            data = event.decode().removeprefix("data: ").strip()
            if data == "[DONE]":
                continue
            obj = json.loads(data)
            now = time.perf_counter()
            if obj.get("choices"):
                if first is None:
                    first = now
                last = now
            if obj.get("usage"):
                usage = obj["usage"]
    conn.close()
    n = usage["completion_tokens"]
    return first - t0, (last - first) / max(n - 1, 1), n


FLOOR_SERVER = r'''
import asyncio, sys
BODY = (b'data: {"choices":[{"text":"x"}]}\n\ndata: {"choices":[],"usage":{"completion_tokens":1}}\n\n'
        b'data: [DONE]\n\n')
async def handle(reader, writer):
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:  # a connect-only probe
        return writer.close()
    length = [line for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
    await reader.readexactly(int(length[0].split(b":")[1]) if length else 0)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                 b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY))
    await writer.drain()
    writer.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    await server.serve_forever()
asyncio.run(main())
'''


def floor_ttfts(prompts) -> list:
    """TTFT (s) of ``stream_once`` against FLOOR_SERVER, one request per prompt (idle gaps between them)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", FLOOR_SERVER, str(port)])
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline:
                    raise SystemExit("the floor server did not start")
                time.sleep(0.05)
        out = []
        for prompt in prompts:
            out.append(stream_once(port, prompt, 1)[0])
            time.sleep(0.02)
        return out
    finally:
        server.terminate()
        server.wait(timeout=30)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    py = sys.executable
    args.model_path = with_word_tokenizer(args.model_path)

    # 1. in-process numbers (separate process, so the two never share the GPU)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([py, "-m", "pegainfer", "bench", "--model-path", args.model_path, "--max-model-len",
                        str(args.max_model_len), "--prompt-len", str(args.prompt_len), "--output-len",
                        str(args.output_len), "--runs", str(args.runs), "--json", f.name], check=True,
                       stdout=subprocess.DEVNULL)
        inproc = json.load(open(f.name))

    # 2. the same through HTTP
    port = free_port()
    server = subprocess.Popen([py, "-m", "pegainfer", "serve", "--model-path", args.model_path, "--port", str(port),
                               "--max-model-len", str(args.max_model_len), "--max-batch", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            raise SystemExit("server did not become healthy")
        rng = np.random.default_rng(0)
        ttfts, tpots = [], []
        for run in range(args.runs + 1):
            prompt = rng.integers(0, 400, size=args.prompt_len).tolist()
            ttft, tpot, n = stream_once(port, prompt, args.output_len)
            if run > 0:
                ttfts.append(ttft)
                tpots.append(tpot)
    finally:
        server.terminate()
        server.wait(timeout=60)
    floor = floor_ttfts([rng.integers(0, 400, size=args.prompt_len).tolist() for _ in range(args.runs + 1)])[1:]
    res = {"in_process_ttft_ms_p50": inproc["ttft_ms"]["p50"], "in_process_tpot_ms_p50": inproc["tpot_ms"]["p50"],
           "http_ttft_ms_p50": 1e3 * float(np.median(ttfts)), "http_tpot_ms_p50": 1e3 * float(np.median(tpots))}
    res["ttft_overhead_ms"] = res["http_ttft_ms_p50"] - res["in_process_ttft_ms_p50"]
    res["tpot_overhead_pct"] = 100 * (res["http_tpot_ms_p50"] / res["in_process_tpot_ms_p50"] - 1)
    res["floor_ttft_ms_p50"] = 1e3 * float(np.median(floor))
    res["ttft_overhead_above_floor_ms"] = res["ttft_overhead_ms"] - res["floor_ttft_ms_p50"]
    for k, v in res.items():
        print(f"{k:<28}{v:>10.3f}")
    if args.json:
        json.dump(res, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
