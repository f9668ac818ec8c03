"""A warm resume from the shared tier (--remote-store) vs a cold prefill, on benchmark model "E", in one run.

Host A (its own save directory) processes a long chat L and a short chat W, then stops; its uploads to the
bucket (a real S3 server, `rclone serve s3`) complete first. Each host B then starts with an empty save
directory on the same bucket and receives L's next turn. Prints medians over --repeat fresh hosts a row (the
rows interleaved, one host of each per round, as the machine's load drifts):

  cold       first-token time (streamed) of L's next turn on a host C without --remote-store: a whole prefill
  per link   B's download time, restore time and first-token time, placement's decision (fetched or
             prefilled) and the break-even estimate it used: entry bytes / measured download speed vs tokens
             gained / llama-server's measured prompt speed. The links: loopback unthrottled, 1 Gbit/s
             (rclone --bwlimit 125M), and a slow link picked below the break-even speed (--slow-factor times
             slower than entry bytes x prompt speed / tokens), where placement should prefill instead.

Placement weighs a download against a prefill only once the host has measured both a download speed and
llama-server's prompt speed (before that it always downloads), so each B first prefills a new chat N (its
prompt speed) and continues W (a download at that link) before L's turn, as a host that has served a while
would have. rclone's --bwlimit is a token bucket that lets up to 4 MiB through at full speed after an idle
spell, so the S3 server is restarted (drained) right before W's download. B hosts run without autosave and
are killed (SIGKILL); the one entry a B uploads (N, written back when L's restore evicts it) has its own
system prompt, so it matches no later host's chats. --fresh adds a row: the slow link on a host that has
measured nothing yet (as right after a swap), where placement downloads without an estimate.

    uv run python benchmarks/remote.py [--tokens 5000] [--repeat 3] [--slow-factor 4] [--slow-limit 300k] [--fresh]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchsetup import llama_server, model_e, slotkeeper_args, stop_slotkeeper, work_dir

from slotkeeper.chat.prefix import BLOCK_TOKENS, block_keys, common_keys
from slotkeeper.demo import DEMO_SEED_TEXT, Turn
from slotkeeper.demo import stream_chat as demo_stream_chat
from slotkeeper.placement.keeper import PREFILL_RATE_MAX_AGE_S
from slotkeeper.testing.harness import Slotkeeper, free_port, http_call, wait_until
from slotkeeper.testing.s3server import S3Server
from slotkeeper.testing.tinymodel import BENCH_MODEL_E

SERVER_ARGS = ["-c", "16384", "-np", "2", "-t", "2", "--no-warmup"]
BUCKET = "bench"
URL = f"s3://{BUCKET}/kv"
GBIT = "125M"  # rclone's M is MiB: 131 MB/s, about a 1 Gbit/s link
W_TOKENS = 400  # the short chat whose download measures B's link
N_TOKENS = 1000  # the new chat whose prefill measures B's prompt speed
MB = 1e6


# ---- chats -----------------------------------------------------------------------------------------------------


def chat_of(tokens: int, per_char: float, topic: str, turn_tokens: int = 600) -> list[dict[str, str]]:
    """system + alternating user/assistant turns of numbered seed text, about `tokens` in all, ending with a user."""
    piece = f"{topic}: {DEMO_SEED_TEXT}"
    per_turn = max(1, int(turn_tokens / (per_char * len(piece))))
    messages = [{"role": "system", "content": f"You are a careful assistant who knows {topic}. " * 4}]
    n_turns = max(1, round(tokens / turn_tokens))
    for t in range(n_turns):
        role = "user" if t % 2 == 0 or t == n_turns - 1 else "assistant"
        if messages[-1]["role"] == role == "user":
            messages.append({"role": "assistant", "content": "Noted."})
        messages.append({"role": role, "content": "".join(f"{t}.{i} {piece}" for i in range(per_turn))})
    return messages


def next_turn(messages: list[dict[str, str]], reply: str, topic: str) -> list[dict[str, str]]:
    return [
        *messages,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": f"Thank you. One more question about {topic}: what comes next?"},
    ]


def body(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {"messages": messages, "max_tokens": 8, "temperature": 0}


def stream_chat(port: int, messages: list[dict[str, str]]) -> Turn:
    """A streamed turn of `body`'s length, as the demo measures it."""
    return demo_stream_chat(port, messages, body(messages)["max_tokens"])


def prompt_keys(port: int, messages: list[dict[str, str]]) -> list[str]:
    """The block keys placement computes for this chat (template applied, tokenized as llama-server does)."""
    prompt = http_call(port, "POST", "/apply-template", body(messages)).body["prompt"]
    tokens = http_call(port, "POST", "/tokenize", {"content": prompt, "add_special": True, "parse_special": True}).body[
        "tokens"
    ]
    return block_keys(tokens)


# ---- hosts -----------------------------------------------------------------------------------------------------


class Hosts:
    def __init__(self, work: Path, model: Path, binary: str) -> None:
        self.work, self.model = work, model
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("LLAMA_", "SLOTKEEPER_", "AWS_"))}
        self.env["LLAMA_SERVER"] = binary
        self.count = 0

    def start(self, name: str, s3: S3Server | None, *own: str) -> Slotkeeper:
        self.count += 1
        port = free_port()
        save_dir = self.work / f"host-{name}"
        own_args = [*(("--remote-store", URL) if s3 is not None else ()), *own]
        args = slotkeeper_args(["-m", str(self.model), *SERVER_ARGS], port, save_dir, own_args)
        env = {**self.env, **(s3.env() if s3 is not None else {})}
        sk = Slotkeeper(args, env, self.work, port, self.work / f"{name}-{self.count}.log").start()
        sk.wait_ready(120)
        return sk


def remote_stats(sk: Slotkeeper) -> dict[str, Any]:
    return http_call(sk.port, "GET", "/slotkeeper/status").body["remote"] or {}


def sk_metric(sk: Slotkeeper, name: str) -> float:
    text = http_call(sk.port, "GET", "/slotkeeper/metrics").body
    found = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def llama_prompt_rate(sk: Slotkeeper) -> float | None:
    """llama-server's lifetime prompt tokens/s from its /metrics (through the proxy), as placement reads it."""
    reply = http_call(sk.port, "GET", "/metrics")
    if reply.status != 200:
        return None
    values = dict(
        line.split(" ", 1)
        for line in str(reply.body).splitlines()
        if line.startswith(("llamacpp:prompt_tokens_total ", "llamacpp:prompt_seconds_total "))
    )
    seconds = float(values.get("llamacpp:prompt_seconds_total", 0))
    return float(values.get("llamacpp:prompt_tokens_total", 0)) / seconds if seconds else None


def manifests(s3root: Path) -> list[dict[str, Any]]:
    return (
        [json.loads(p.read_text()) for p in (s3root / BUCKET / "kv").rglob("*.json")]
        if (s3root / BUCKET / "kv").exists()
        else []
    )


# ---- one B host -------------------------------------------------------------------------------------------------


@dataclass
class Run:
    link: str
    w_speed: float  # bytes/s of W's download: the speed placement measured (its only download before L)
    rate_used: float | None  # llama-server's prompt tokens/s as placement last read it before L's turn
    fetched: bool
    prefill_faster: int  # slotkeeper_remote_prefill_faster delta
    logged: str | None  # the "...slower than prefilling...: prefilling" line
    download_s: float
    download_bytes: int
    restore_s: float
    first_token_s: float
    fetch_failed: int = 0  # the remote stats' fetches_failed delta
    timings: dict[str, Any] = field(default_factory=dict)


def run_b(hosts: Hosts, s3: S3Server, link: str, w_next, l_next, per_char: float, warm: bool = True) -> Run:
    """One fresh host B on this link: (warm) N and W first, then L's next turn, measured."""
    s3.start()
    b = hosts.start("b", s3, "--autosave-idle", "0")
    try:
        w_speed, rate_used = float("nan"), None
        if warm:
            # a new chat, found nowhere (its own system prompt): llama-server measures its prompt speed
            stream_chat(b.port, chat_of(N_TOKENS, per_char, f"night trains ({os.urandom(6).hex()})", N_TOKENS))
            rate_after_n = llama_prompt_rate(b)
        s3.stop()  # drain rclone's token bucket: the next download goes at the limit from its first byte
        s3.start()
        before_w = remote_stats(b)
        if warm:
            w_sent = time.monotonic()
            stream_chat(b.port, w_next)  # W comes from the bucket: slotkeeper measures the link
            # with nothing measured yet, the turn waits at most its estimated prefill and the download goes on
            wait_until(lambda: remote_stats(b)["download_bytes"] > before_w["download_bytes"], 300, interval=0.2)
        after_w = remote_stats(b)
        if warm:
            rate_after_w = llama_prompt_rate(b)
            w_bytes = after_w["download_bytes"] - before_w["download_bytes"]
            w_seconds = after_w["download_seconds"] - before_w["download_seconds"]
            assert w_bytes > 0, f"W was not downloaded:\n{b.logs()[-3000:]}"
            w_speed = w_bytes / max(w_seconds, 1e-9)
            # placement re-reads the prompt speed at most every PREFILL_RATE_MAX_AGE_S: W's placement read it
            # (after N); L's re-reads it (after W's new message too) only when that is older
            rate_used = rate_after_w if time.monotonic() - w_sent >= PREFILL_RATE_MAX_AGE_S else rate_after_n
        restore0 = sk_metric(b, "slotkeeper_restore_seconds_sum")
        faster0 = sk_metric(b, "slotkeeper_remote_prefill_faster_total")
        fetches0 = sk_metric(b, "slotkeeper_remote_fetches_total")
        log_mark = len(b.logs())
        turn = stream_chat(b.port, l_next)
        after = remote_stats(b)
        lines = b.logs()[log_mark:]
        logged = next((ln for ln in lines.splitlines() if "slower than prefilling" in ln), None)
        return Run(
            link,
            w_speed,
            rate_used,
            fetched=sk_metric(b, "slotkeeper_remote_fetches_total") > fetches0,
            prefill_faster=int(sk_metric(b, "slotkeeper_remote_prefill_faster_total") - faster0),
            logged=logged[logged.find("chat ") :] if logged else None,
            download_s=after["download_seconds"] - after_w["download_seconds"],
            download_bytes=after["download_bytes"] - after_w["download_bytes"],
            restore_s=sk_metric(b, "slotkeeper_restore_seconds_sum") - restore0,
            first_token_s=turn.first_token_s,
            timings=turn.timings,
            fetch_failed=after["fetches_failed"] - after_w["fetches_failed"],
        )
    finally:
        b.stop()
        s3.stop()
        shutil.rmtree(hosts.work / "host-b", ignore_errors=True)


def rclone_rate(limit: str) -> float:
    """bytes/s of an rclone --bwlimit value (k, M, G are powers of 1024)."""
    found = re.fullmatch(r"([0-9.]+)([kKMG]?)", limit)
    if not found:
        raise ValueError(f"--slow-limit {limit!r}: a number with k, M or G, as rclone's --bwlimit takes")
    return float(found.group(1)) * {"": 1, "k": 1024, "K": 1024, "M": 1024**2, "G": 1024**3}[found.group(2)]


def measured(r: Run) -> str:
    if r.rate_used is None:
        return "nothing measured before"
    return f"W at {r.w_speed / MB:.2f} MB/s, prompt speed {r.rate_used:,.0f} tok/s"


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ---- main -------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=5000, help="length of the long chat L (default 5000)")
    parser.add_argument("--repeat", type=int, default=3, help="fresh B (and C) hosts per row (default 3)")
    parser.add_argument(
        "--slow-factor",
        type=float,
        default=4.0,
        help="the slow link is this many times below the break-even speed (default 4)",
    )
    parser.add_argument("--slow-limit", help="the slow link's rclone --bwlimit instead (e.g. 300k)")
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="also the slow link with a host that measured nothing yet (no N, no W): it downloads "
        "whatever the link (slow: about --slow-factor times the prefill)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, bucket)")
    args = parser.parse_args()
    started = time.monotonic()

    binary = llama_server()
    model = model_e()
    work = work_dir("remote")
    s3root = work / "s3"
    hosts = Hosts(work, model, binary)
    try:
        # ---- host A: L and W, stopped; uploads complete ------------------------------------------------------
        s3 = S3Server(s3root, bucket=BUCKET).start()
        a = hosts.start("a", s3)
        probe = DEMO_SEED_TEXT * 8
        per_char = len(http_call(a.port, "POST", "/tokenize", {"content": probe}).body["tokens"]) / len(probe)
        l_msgs = chat_of(args.tokens, per_char, "lighthouses")
        w_msgs = chat_of(W_TOKENS, per_char, "old maps", turn_tokens=W_TOKENS)
        w_reply = stream_chat(a.port, w_msgs).content
        l_first = stream_chat(a.port, l_msgs)
        assert stop_slotkeeper(a, 60) == 0, a.logs()
        if not wait_until(lambda: len(manifests(s3root)) >= 2, 2):  # the stop's budget ended first: resume
            a = hosts.start("a", s3)
            assert wait_until(lambda: len(manifests(s3root)) >= 2, 60), a.logs()
            stop_slotkeeper(a, 60)
        uploads = [
            (float(m.group(2)), m.group(1))
            for m in re.finditer(
                r"uploaded: (\S+ \S+) in ([\d.]+) s", "".join(p.read_text() for p in work.glob("a-*.log"))
            )
        ]
        s3.stop()
        found = sorted(manifests(s3root), key=lambda m: m["tokens"])
        w_entry, l_entry = found[0], found[-1]
        l_next = next_turn(l_msgs, l_first.content, "lighthouses")
        w_next = next_turn(w_msgs, w_reply, "old maps")

        # ---- side by side, interleaved (the machine's load drifts): C cold, then B on each link ------------------
        colds: list[Turn] = []
        links: list[tuple[str, str | None]] = [("loopback", None), ("1 Gbit/s", GBIT)]
        runs: dict[str, list[Run]] = {label: [] for label, _ in links}
        slow = slow_label = ""
        gained, rate_b, break_even = 0, 0.0, 0.0
        for i in range(args.repeat):
            c = hosts.start("c", None, "--autosave-idle", "0")  # cold: a host without --remote-store
            try:
                if i == 0:  # the tokens of the turn L's entry covers, as placement counts them
                    gained = common_keys(prompt_keys(c.port, l_next), l_entry["blocks"]) * BLOCK_TOKENS
                colds.append(stream_chat(c.port, l_next))
            finally:
                c.stop()
                shutil.rmtree(work / "host-c", ignore_errors=True)
            for label, limit in links[:2]:
                runs[label].append(
                    run_b(hosts, S3Server(s3root, bucket=BUCKET, bwlimit=limit), label, w_next, l_next, per_char)
                )
            if i == 0:  # the slow link, from the prompt speed placement read on the first fast hosts
                rate_b = med([r.rate_used for label, _ in links for r in runs[label] if r.rate_used])
                break_even = l_entry["bytes"] * rate_b / gained  # bytes/s: the download takes as long as the prefill
                floor = w_entry["bytes"] / 20  # W must still come within slotkeeper's 30 s per-read limit
                slow = args.slow_limit or f"{int(max(break_even / args.slow_factor, floor) / 1024) + 1}k"
                slow_label = f"{rclone_rate(slow) / MB:.2f} MB/s"
                links.append((slow_label, slow))
                runs[slow_label] = []
            runs[slow_label].append(
                run_b(hosts, S3Server(s3root, bucket=BUCKET, bwlimit=slow), slow_label, w_next, l_next, per_char)
            )
        if args.fresh:
            fresh_label = f"{slow_label}*"
            runs[fresh_label] = [
                run_b(
                    hosts,
                    S3Server(s3root, bucket=BUCKET, bwlimit=slow),
                    fresh_label,
                    w_next,
                    l_next,
                    per_char,
                    warm=False,
                )
            ]
            links.append((fresh_label, slow))
        cold_ft = med([c.first_token_s for c in colds])
        cold_rate = med([c.timings["prompt_n"] / c.timings["prompt_ms"] * 1000 for c in colds])
        l_prompt = colds[0].timings.get("prompt_n", 0) + colds[0].timings.get("cache_n", 0)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    elapsed = time.monotonic() - started

    # ---- report ---------------------------------------------------------------------------------------------------
    print(
        f"benchmark model E: {BENCH_MODEL_E.n_layers} layers x {BENCH_MODEL_E.width}, f16, "
        f"{model.stat().st_size / MB:.1f} MB; {' '.join(SERVER_ARGS)}; medians of {args.repeat} hosts a row"
    )
    print(
        f"chat L's next turn: {l_prompt:,} prompt tokens; L's entry {l_entry['bytes'] / MB:.1f} MB "
        f"({l_entry['tokens']:,} tokens, {l_entry['bytes'] / l_entry['tokens']:.0f} B/token) covers {gained:,} "
        f"of them; W's entry {w_entry['bytes'] / MB:.2f} MB"
    )
    if uploads:
        print("host A's uploads (unthrottled): " + ", ".join(f"{size} in {s:.1f} s" for s, size in uploads))
    print(
        f"prompt speed: L's cold prefill {cold_rate:,.0f} tok/s (llama-server's timings); what placement read "
        f"(llama-server's /metrics, lifetime) {rate_b:,.0f} tok/s"
    )
    print(
        f"break-even link speed for L: {l_entry['bytes'] / MB:.1f} MB x {rate_b:,.0f} tok/s / {gained:,} tokens "
        f"= {break_even / MB:.2f} MB/s; slow link: --bwlimit {slow} = {slow_label}"
    )
    print()
    head = (
        f"{'link':<13} {'decision':<10} {'download':>9} {'restore':>8} {'prefill':>9} {'first token':>11} "
        f"{'vs cold':>7}  placement's estimate: fetch (bytes / W's speed) vs prefill (tokens / rate)"
    )
    print(head)
    print("-" * len(head))
    cold_prefill_s = med([c.timings["prompt_ms"] for c in colds]) / 1000
    print(f"{'cold (C)':<13} {'prefill':<10} {'-':>9} {'-':>8} {cold_prefill_s:>7.2f} s {cold_ft:>9.2f} s {1.0:>6.2f}x")
    for label, _ in links:
        rs = runs[label]
        fetched = sum(r.fetched for r in rs)
        decision = "fetched" if fetched == len(rs) else "prefilled" if not fetched else f"fetch {fetched}/{len(rs)}"
        if any(r.fetch_failed for r in rs):
            decision = f"failed {sum(r.fetch_failed > 0 for r in rs)}/{len(rs)}"
        speed = med([r.w_speed for r in rs])
        rates = [r.rate_used for r in rs if r.rate_used]
        if rates and speed == speed:
            fetch_est, prefill_est = l_entry["bytes"] / speed, gained / med(rates)
            estimate = (
                f"{fetch_est:.2f} s ({speed / MB:.2f} MB/s) vs {prefill_est:.1f} s ({med(rates):,.0f} tok/s) "
                f"-> {'fetch' if fetch_est < prefill_est else 'prefill'}"
            )
        else:
            estimate = "none (nothing measured yet on this host) -> fetch"
        dl = [r.download_s for r in rs if r.fetched]
        rst = [r.restore_s for r in rs if r.fetched]
        ft = med([r.first_token_s for r in rs])
        print(
            f"{label:<13} {decision:<10} {(f'{med(dl):.2f} s' if dl else '-'):>9} "
            f"{(f'{med(rst) * 1000:.0f} ms' if rst else '-'):>8} "
            f"{med([r.timings.get('prompt_ms', 0) for r in rs]) / 1000:>7.2f} s {ft:>9.2f} s {ft / cold_ft:>6.2f}x  "
            f"{estimate}"
        )
    print("  download: GET to fsynced file (remote stats download_seconds); restore: slotkeeper_restore_seconds;")
    print("  prefill: llama-server's prompt_ms for the turn (the new messages after a restore, all of it cold)")
    if args.fresh:
        print(
            f"  {slow_label}*: a host that has measured neither a download nor a prompt speed (as right after a "
            "swap): no N, no W"
        )
    print()
    print("each host:")
    for cold in colds:
        print(
            f"  {'cold (C)':<12} first token {cold.first_token_s:.2f} s; prompt_n {cold.timings.get('prompt_n')} "
            f"in {cold.timings.get('prompt_ms', 0):.0f} ms"
        )
    for label, _ in links:
        for r in runs[label]:
            t = r.timings
            print(
                f"  {label:<12} fetched {r.download_bytes / MB:.1f} MB in {r.download_s:.2f} s, restore "
                f"{r.restore_s * 1000:.0f} ms, first token {r.first_token_s:.2f} s; cache_n {t.get('cache_n')}, "
                f"prompt_n {t.get('prompt_n')} in {t.get('prompt_ms', 0):.0f} ms; {measured(r)}; "
                f"remote_prefill_faster +{r.prefill_faster}"
                if r.fetched
                else f"  {label:<12} prefilled: first token {r.first_token_s:.2f} s; cache_n {t.get('cache_n')}, "
                f"prompt_n {t.get('prompt_n')} in {t.get('prompt_ms', 0):.0f} ms; {measured(r)}; "
                f"remote_prefill_faster +{r.prefill_faster}"
            )
            if r.logged:
                print(f"      log: {r.logged}")
            if r.fetch_failed:
                print("      the download failed (remote fetches_failed +1; see the host's log), then it prefilled")
    print(f"\n(total {elapsed:.0f} s{f'; logs and bucket in {work}' if args.keep else ''})")


if __name__ == "__main__":
    main()
