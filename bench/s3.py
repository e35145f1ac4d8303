"""`streamload bench` against an S3 endpoint on this machine: moto's S3 server on 127.0.0.1, the
checkpoint uploaded to it, then streamload's range reader and runai-model-streamer's S3 reader side
by side, each run a fresh process, alternating (`streamload bench s3://...` with the endpoint in the
standard AWS environment).

    pip install -e ".[test,bench]" runai-model-streamer-s3
    python bench/s3.py /tmp/streamload-s3 --runs 3       # writes a checkpoint there if it holds none

moto keeps objects in memory and serves a ranged GET by reading the object whole, so its cost grows
with the object: the checkpoint is cut into small shards (~80 MB) to keep the server from dominating.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path, help="a local checkpoint directory (made if empty)")
    ap.add_argument("--runs", type=int, default=3, help="default: %(default)s")
    ap.add_argument("--device", default="cpu", help="default: %(default)s")
    ap.add_argument("--layers", type=int, default=8, help="for a new checkpoint (default: %(default)s)")
    ap.add_argument("--shards", type=int, default=16, help="for a new checkpoint (default: %(default)s)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not list(args.checkpoint.glob("*.safetensors")):
        here = Path(__file__).parent
        cmd = [sys.executable, str(here / "make_checkpoint.py"), str(args.checkpoint),
               "--layers", str(args.layers), "--shards", str(args.shards)]  # fmt: skip
        subprocess.run(cmd, check=True)

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update({
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint, "AWS_EC2_METADATA_DISABLED": "true",
        "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",  # path-style URLs, as a local endpoint needs
    })  # fmt: skip
    try:
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket="bench")
        for f in sorted(args.checkpoint.iterdir()):
            if f.is_file():  # one PUT each: runai's reader failed on every run on objects that moto
                # stored from a multipart upload ("File access error"), which streamload read
                s3.put_object(Bucket="bench", Key=f"model/{f.name}", Body=f.read_bytes())
        cmd = [sys.executable, "-m", "streamload", "bench", "s3://bench/model/", "--device", args.device,
               "--runs", str(args.runs), "--loaders", "streamload-range", "runai-s3"]  # fmt: skip
        if args.json:
            cmd += ["--json", str(args.json)]
        sys.exit(subprocess.run(cmd).returncode)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
