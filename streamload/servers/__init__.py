"""Servers streamload runs: the seeder (verified copies to peers), bounded at accept, authenticated."""
