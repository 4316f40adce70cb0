"""The arithmetic of bench.device.page_key_layer_profile (the page-key kernel's split plans, the
per-layer attribution of a row's parts), apart from its timing code."""
from __future__ import annotations

PAGE_KEY = {"k6v4-kivi": 6, "int4-kivi": 4}
KT = 64              # the page-key kernel's keys per tile


def plan(rows: int, kv_heads: int, longest: int, n: int, target=None, min_keys=None,
         splits=None) -> dict:
    """The page-key kernel's split plan for rows of n keys (page_key_decode_attention's host
    arithmetic and the source's per-split key ranges: whole 64-key tiles)."""
    from engine.attention.cuda.page_key_decode import MIN_KEYS, TARGET_BLOCKS
    from engine.attention.cuda.paged_decode import split_count
    s = splits or split_count(rows, kv_heads, longest, target or TARGET_BLOCKS,
                              min_keys or MIN_KEYS)
    per = -(-(-(-n // s)) // KT) * KT
    active = -(-n // per)   # splits past the row's end idle
    return {"splits": s, "blocks": rows * kv_heads * s, "active_splits": active,
            "working_blocks": rows * kv_heads * active, "keys_per_split": per,
            "tiles_per_split": per // KT}


def attribution(row: dict) -> dict:
    """Per layer, us over native's (whose kernel writes its row): the page-key kernel at the
    default and best plan, its write, a pool copy, and the whole step's extra per layer."""
    out = {}
    k, w, s = row.get("kernel", {}).get("variants"), row.get("write"), row.get("step", {})
    for fmt in PAGE_KEY:
        a = {}
        if k:
            best = row["kernel"]["best_plan"][fmt]
            a["kernel_extra_us"] = round(k[f"{fmt}:default"]["us"] - k["native"]["us"], 2)
            a["kernel_extra_us_best_plan"] = round(k[best]["us"] - k["native"]["us"], 2)
        if w and fmt in w:
            a["write_us"] = w[fmt]["us"]
            a["write_pool_copy_us"] = round(w[f"{fmt}:held"]["us"] - w[fmt]["us"], 2)
            if f"{fmt}:fused" in w:
                a["write_fused_us"] = w[f"{fmt}:fused"]["us"]
        for spec in (fmt, f"{fmt}:fused-write"):
            if "extra_ms_per_layer" in s.get(spec, {}):
                a[f"step_extra_us_per_layer{spec[len(fmt):]}"] = round(
                    1e3 * s[spec]["extra_ms_per_layer"], 2)
        out[fmt] = a
    return out
