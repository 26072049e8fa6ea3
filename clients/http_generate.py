#!/usr/bin/env python3
"""Generate once from a Trident entry model over HTTP (Triton's generate extension).

    python clients/http_generate.py --image photo.png --prompt "Describe the picture." [--mode e_pd]
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request

from grpc_stream import MEDIA, PLACEHOLDERS, add_media_flags, chat_prompt, read_media


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="Triton HTTP URL (default: http://127.0.0.1:8000)")
    ap.add_argument("--mode", default="e_p_d", choices=["epd", "e_pd", "e_p_d", "ep_d"], help="entry model")
    add_media_flags(ap)
    ap.add_argument("--prompt", default="Describe the picture.")
    ap.add_argument("--arch", default="llava", choices=list(PLACEHOLDERS))
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()

    media = read_media(args)
    body = {
        "text_input": chat_prompt(args.arch, args.prompt, *(len(media[kind]) for kind in MEDIA)),
        **{kind: items for kind, items in media.items() if items},
        "sampling_parameters": json.dumps({"max_tokens": args.max_tokens, "temperature": 0}),
        "exclude_input_in_output": True,
        "return_finish_reason": True,
    }
    request = urllib.request.Request(
        f"{args.url}/v2/models/{args.mode}/generate", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            out = json.loads(response.read())
    except urllib.error.HTTPError as e:
        print(f"error {e.code}: {json.loads(e.read()).get('error')}", file=sys.stderr)
        return 1
    print(out["text_output"])
    print(f"[finish_reason: {out.get('finish_reason')}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
