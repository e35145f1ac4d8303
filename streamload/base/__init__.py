"""What every layer uses: errors, process-wide limits and tuning, atomic writes, leftovers of dead processes,
page release, the collector's pause, stats, the progress bar, argument checks, settings (every STREAMLOAD_*
variable)."""
