"""The pipeline: plan -> read -> device -> deliver, slot by slot (ring, backpressure); the stream's one core
with a plain and an async face; which reader serves which storage and device; `verify=` while streaming."""
