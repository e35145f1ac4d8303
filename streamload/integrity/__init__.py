"""The integrity layer: every byte a load hands out that was not read from the origin in this very load (a
peer's, a cache copy's, a hub download's, a staging copy's) is checked here, against digests bound to the
origin's version, before it is handed out; no source checks on its own. `digests`: the digest file;
`blocks`: a file's origin-bound blocks and the verdict on blocks from elsewhere (a peer's); `whole`: a
whole file's digest, hashed in file order and judged at the end (a hub download's).
"""
