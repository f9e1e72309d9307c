"""kernels/launch.py's view memo (the launch memo itself needs a GPU: test_forward_cuda.py)."""
import gc

from ds4py.kernels import launch


class _Array:
    """Stands in for a device array: weak-referenceable, sliceable by a counter."""
    made = 0

    def slice(self):
        _Array.made += 1
        return ("view", _Array.made)


def test_view_is_made_once_per_array_and_key():
    a, b = _Array(), _Array()
    first = launch.view(a, "k", _Array.slice)
    assert launch.view(a, "k", _Array.slice) is first
    assert launch.view(a, "other", _Array.slice) != first
    assert launch.view(b, "k", _Array.slice) != first


def test_view_is_dropped_when_its_array_dies():
    a = _Array()
    launch.view(a, "gone", _Array.slice)
    key = (id(a), "gone")
    assert key in launch._views
    del a
    gc.collect()
    assert key not in launch._views
