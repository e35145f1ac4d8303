"""Loads shared by ranks (a process group: who reads which share, a lost rank) and by fleets of nodes."""
