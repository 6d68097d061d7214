"""A teacher outside the trainer's memory: served over vLLM's API, or truncated to its top-k in process.

- [`protocol`](./protocol.py): the wire format (vLLM's `/v1/completions` with `prompt_logprobs`), both directions;
- [`client`](./client.py): [`TeacherClient`], the trainer's side, with timeouts, bounded retries and an API key;
- [`server`](./server.py): `hf-rockopd serve-teacher`, the same API on a machine without vLLM (a CPU);
- [`sources`](./sources.py): what the engine asks for targets: [`ServedTeacher`], [`ServedTeachers`] (several, routed
  by a dataset column `teacher`), [`ModelTopKTeacher`];
- [`cache`](./cache.py): the offline teacher cache ([`TeacherCache`], Parquet) and [`CachedTeacher`], its source.

The loss against these targets is `hf_rockopd.losses.sparse` (the listed ids plus a tail bin).

Example:
```python
>>> from hf_rockopd.teachers import TeacherClient, ServedTeacher
>>> ServedTeacher(TeacherClient("http://127.0.0.1:8000"), top_k=16).source
'server http://127.0.0.1:8000'
```
"""

from .cache import CACHE_FORMAT, CacheSettings, CachedTeacher, TeacherCache, connect_teacher_source
from .client import API_KEY_ENV, TeacherClient, TeacherServerError
from .protocol import MalformedTeacherResponse
from .sources import ModelTopKTeacher, ServedTeacher, ServedTeachers, TopKTeacher, connect_served_teacher


__all__ = [
    "API_KEY_ENV",
    "CACHE_FORMAT",
    "CacheSettings",
    "CachedTeacher",
    "MalformedTeacherResponse",
    "ModelTopKTeacher",
    "ServedTeacher",
    "ServedTeachers",
    "TeacherCache",
    "TeacherClient",
    "TeacherServerError",
    "TopKTeacher",
    "connect_served_teacher",
    "connect_teacher_source",
]
