"""Start-up work shared by the framework integrations and the commands: fetching ahead of a
framework's import, staged compile caches, pinned digests."""
