"""The pure-math attack core: tensors in, tensors out. No I/O, no printing, no ground truth."""
