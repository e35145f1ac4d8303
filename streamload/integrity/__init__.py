"""The integrity layer: every byte a load hands out that was not read from the origin in this very load (a
peer's, a cache copy's, a hub download's, a staging copy's) is checked here, against digests bound to the
origin's version, before it is handed out; no source checks on its own.

- `digests`: the digest file (`streamload.digests.json`): format 2, a BLAKE3 per block of each tensor and the
  origin version each entry was made from; format 1 (xxh3-64), a check against corruption only.
- `blocks`: a file's checked blocks (only from a format-2 entry bound to the origin's version) and the verdict
  on blocks from elsewhere (a peer's): matched, forged (the origin's matched instead) or stale (it failed too).
- `whole`: a whole file's digest (SHA-256, a git blob's SHA-1, MD5), hashed in file order as the bytes arrive
  and judged at the end: a hub download's verdict (`WholeFile`; a mismatch is `WholeFileMismatch`).
"""
