"""What phoneme-synchronous decoding costs the engine: step time with and without the constraint.

Both sides run the same 64 prompts through the same engine settings for exactly the same number
of tokens each: the unconstrained side ignores EOS with a fixed max_tokens, the constrained side
follows a forced duration schedule that ends at that very length. The two engines live in one
process and step in lockstep (a plain step, then a constrained one, alternating which goes
first), so a machine shared with other work slows both sides alike. The figure is the median
over runs of the ratio of summed step times (constrained / plain), so 1.03 is a 3% overhead; it
is given for wall time and for the process's CPU time.

    python -m bench.phoneme_sync [--model voices/default/lm] [--seqs 64] [--tokens 160] [--runs 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from bench.engine import machine_load


def _prompts(tokenizer_path: str, n: int) -> list[list[int]]:
    """Phoneme prompts of the default voice's format, from its own front end's kind of text."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    base = [
        "h@l'oU D'e@ mI2 fr'End",
        "D@ w'ED3 t@d'eI Iz k'u:l and br'aIt",
        "wi: w'Il w'O:k t@ D@ p'A@k 'aeft3 l'VntS",
        "D'Is Iz D@ d'Ifo@lt v'OIs",
        "tS;'i55n_| th'iE55n_| X'@35n_| X'Au214_|",
    ]
    out = []
    for i in range(n):
        text = " ".join(base[(i + k) % len(base)] for k in range(1 + i % 3))
        out.append(tok.encode(f"<|bos|>{text}<|sep|>", add_special_tokens=False).ids)
    return out


def build(
    model: str,
    seqs: int,
    tokens: int,
    constrained: bool,
    prompts,
    speech: tuple[int, int],
    end: int,
    temperature: float = 0.7,
    decode_graphs: int = 8,
):
    """An engine holding `seqs` requests of exactly `tokens` output tokens each, sampled at
    `temperature` with top-k 50 (0: greedy, as the default voice decodes); decode steps of up
    to `decode_graphs` sequences replay captured graphs (0: eager)."""
    from text_service.constraints import PhonemeSync
    from text_service.engine import EngineArgs, LLMEngine
    from text_service.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineArgs(
            model=model,
            device="cpu",
            max_num_seqs=seqs,
            seed=0,
            kv_cache_memory_bytes=1 << 29,
            enable_prefix_caching=False,
            decode_graphs=decode_graphs,
        )
    )
    for i, prompt in enumerate(prompts):
        if constrained:
            phonemes = prompt[1:-1]
            n = len(phonemes)
            speech_total = tokens - n - 1
            d = [speech_total // n + (1 if k < speech_total % n else 0) for k in range(n)]
            c = PhonemeSync(tuple(phonemes), speech, end, tuple(d), tuple(d))
            sp = SamplingParams(
                temperature=temperature, top_k=50, seed=i, max_tokens=tokens, phoneme_sync=c
            )
        else:
            sp = SamplingParams(
                temperature=temperature, top_k=50, seed=i, max_tokens=tokens, ignore_eos=True
            )
        engine.add_request(f"r{i}", prompt, sp)
    return engine


def lockstep(engines: list[tuple[str, object]], expected: int) -> dict[str, list[float]]:
    """Step the named engines in turn, in the order given, until all are done; seconds of wall
    and CPU time each spent in its steps, and how many steps it took: `[wall, cpu, steps]`."""
    spent = {name: [0.0, 0.0, 0] for name, _ in engines}
    produced = dict.fromkeys(spent, 0)
    while any(e.has_unfinished_requests() for _, e in engines):
        for name, engine in engines:
            if not engine.has_unfinished_requests():
                continue
            w, c = time.perf_counter(), time.process_time()
            outs = engine.step()
            spent[name][0] += time.perf_counter() - w
            spent[name][1] += time.process_time() - c
            spent[name][2] += 1
            produced[name] += sum(len(o.new_token_ids) for o in outs)
    for name, n in produced.items():
        if n != expected:
            raise RuntimeError(f"{name}: expected {expected} tokens, got {n}")
    return spent


def run_pair(plain, synced, expected: int, sync_first: bool) -> dict:
    """Step both engines in lockstep until done; seconds of wall and CPU time spent in each."""
    order = [("plain", plain), ("sync", synced)]
    return lockstep(order[::-1] if sync_first else order, expected)


def parser(doc: str | None, seqs: int | str) -> argparse.ArgumentParser:
    """The options of the benchmarks that step a speech LM's engines (`--seqs` of `seqs`' type:
    one batch size, or several comma-separated)."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="voices/default/lm")
    p.add_argument("--seqs", type=type(seqs), default=seqs)
    p.add_argument("--tokens", type=int, default=160)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", action="store_true")
    return p


def voice_tokens(model: str) -> tuple[tuple[int, int], int]:
    """The speech-token range and end id of the voice whose `lm/` folder is `model`."""
    manifest = json.load(open(f"{model}/../voice.json"))
    lo, hi = manifest["speech_token_range"]
    return (lo, hi), manifest["end_token_id"]


def main() -> None:
    args = parser(__doc__, 64).parse_args()
    torch.set_num_threads(args.threads)
    speech, end = voice_tokens(args.model)
    prompts = _prompts(f"{args.model}/tokenizer.json", args.seqs)
    load_before = machine_load()

    def pair(first: bool) -> dict:
        return run_pair(
            build(args.model, args.seqs, args.tokens, False, prompts, speech, end),
            build(args.model, args.seqs, args.tokens, True, prompts, speech, end),
            args.seqs * args.tokens,
            first,
        )

    pair(False)  # warm-up
    wall, cpu, plain_s, sync_s = [], [], [], []
    for r in range(args.runs):
        spent = pair(bool(r % 2))
        plain_s.append(spent["plain"][0])
        sync_s.append(spent["sync"][0])
        wall.append(spent["sync"][0] / spent["plain"][0])
        cpu.append(spent["sync"][1] / spent["plain"][1])
        print(
            f"plain {plain_s[-1]:.3f} s  phoneme_sync {sync_s[-1]:.3f} s  wall ratio "
            f"{wall[-1]:.4f}  cpu ratio {cpu[-1]:.4f}",
            file=sys.stderr,
            flush=True,
        )
    result = {
        "seqs": args.seqs,
        "tokens_per_seq": args.tokens,
        "runs": args.runs,
        "threads": args.threads,
        "plain_s_median": statistics.median(plain_s),
        "phoneme_sync_s_median": statistics.median(sync_s),
        "step_time_ratio": statistics.median(wall),
        "cpu_time_ratio": statistics.median(cpu),
        "ratios": [round(r, 4) for r in wall],
        "cpu_ratios": [round(r, 4) for r in cpu],
        "goal": "<= 1.03",
        "load_before": load_before,
        "load_after": machine_load(),
    }
    print(json.dumps(result, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
