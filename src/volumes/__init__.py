"""``python -m src.volumes data=nifti data.root=<folder>``: the command that builds a NIfTI folder's cache and describes
it; the pipeline itself is :mod:`src.data.nifti`."""
