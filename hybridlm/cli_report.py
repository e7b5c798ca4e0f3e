"""The command line's human-readable report (`hybridlm prefill` / `generate` without --json)."""

from __future__ import annotations


def print_report(r: dict) -> None:
    if r.get("dry_run"):
        print(r["memory_text"])
        print(f"chunk size     {r['chunk_reason']}")
        print("fits" if r["fits"] else f"does not fit: {r['refusal']}")
        return
    print(f"model          {r['model']}  [{r['dtype']}, {r['device']}, JAX {r['jax_version']}]")
    print(f"prompt tokens  {r['prompt_tokens']}  in {r['chunks']} chunk(s) of {r['chunk_size']}")
    if "chunk_reason" in r:
        print(f"chunk size     {r['chunk_reason']}")
    note = "after warm-up" if r["compile_excluded"] else "includes compilation"
    rss = r["peak_rss_bytes"] / 2**30
    print(f"load           {r['load_s']:.2f} s to prefill-ready; peak host RSS {rss:.2f} GiB")
    first = r["command_to_first_token_s"]
    print(f"TTFT           {r['ttft_s']:.3f} s ({note}); command to first token {first:.2f} s")
    c = r["compile"]
    print(
        f"compile        {c['compile_s']:.2f} s; persistent cache {c['cache_dir'] or 'off'} "
        f"({c['cache_hits']} hits, {c['cache_misses']} misses)"
    )
    print(f"prefill        {r['prefill_tokens_per_s']:.1f} tokens/s")
    if "phase_seconds" in r:
        total = sum(r["phase_seconds"].values()) or 1.0
        print("per phase (profiled pass, synchronised after each phase):")
        for phase, sec in r["phase_seconds"].items():
            print(f"  {phase:10s} {sec * 1e3:9.2f} ms  {100 * sec / total:5.1f}%")
    if "offload" in r:
        print_offload(r["offload"])
    if "next_token" in r:
        print(f"next token     {r['next_token']['id']} {r['next_token']['text']!r}")
    if "text" in r:
        print(f"generated      {r['text']!r}")
        print(f"stopped        at {r['stop_reason']} after {len(r['new_tokens'])} token(s)")
        print(f"decode         {r['decode_tokens_per_s']:.1f} tokens/s")
    if "speculative" in r:
        sp = r["speculative"]
        accept = ", ".join(f"{a:.2f}" for a in sp["acceptance_per_position"])
        print(
            f"speculative    {sp['method']}: {sp['tokens_per_iteration']:.2f} tokens per verify over "
            f"{sp['iterations']} verifies, draft tokens {sp['draft_tokens']}, acceptance by position "
            f"[{accept}]"
        )


def print_offload(o: dict) -> None:
    pool = o["pool"]
    from hybridlm.offload.expert_cache import format_bytes

    print(
        f"expert offload budget {format_bytes(pool['budget_bytes'])}, {pool['slots']} slots of "
        f"{pool['expert_bytes']} B (+{pool['staging_slots']} staging), policy {pool['policy']}, "
        f"prefetch {pool['prefetch']}, {pool['host_parts']} host buffer(s) a layer; experts stored as "
        f"{pool['expert_format']}"
    )
    for kind in ("prefill", "decode"):
        s = o[kind]
        if not s["chunks"]:
            continue
        # device-paged decode steps are never waited for, so they have no wall time of their own
        rate = f"{s['achieved_gbps']:.2f} GB/s" if s["wall_s"] > 0 else "GB/s untimed"
        print(
            f"  {kind:8s} lookups {s['lookups']}  hits {s['hits']}  misses {s['misses']}  hit rate "
            f"{100 * s['hit_rate']:.1f}%  H2D {s['bytes_h2d'] / 1e9:.3f} GB  {rate}  "
            f"stall {s['stall_s'] * 1e3:.1f} ms  evictions {s['evictions']}  prefetched {s['prefetched']} "
            f"(used {s['prefetch_used']})"
        )
    layers = o["prefill"].get("per_layer", [])
    if layers:
        print("  per layer (prefill): hit rate % / H2D MB / stall ms")
        print(
            "   "
            + "  ".join(
                f"{i}:{100 * s['hit_rate']:.0f}/{s['bytes_h2d'] / 1e6:.1f}/{s['stall_s'] * 1e3:.1f}"
                for i, s in enumerate(layers)
            )
        )
