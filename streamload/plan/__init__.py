"""What to read and where it lands: a checkpoint's files and headers, the plan (order, groups of byte ranges
per slot), shards (which bytes a rank reads), placement (renames, fusions), layer keys."""
