"""Where each checkpoint tensor lands, learnt before a byte is read: a dry run of the model's own
`load_weights` on stand-ins and a watched replay of the real call (`dryrun.py`, built from
`learned.py`, `standin.py` and `recorder.py`), and layers that load alike, placed from one dry-run
layer (`twins.py`)."""
