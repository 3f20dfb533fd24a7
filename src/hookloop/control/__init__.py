"""Remote control of running jobs: an authenticated HTTP server, a job registry,
a client, a live dashboard, and the ``hookloop jobs`` / ``hookloop ctl`` commands.

Nothing here is imported by the core; aiohttp is needed only by the server
(``pip install 'hookloop[control]'``), and only when it starts.

>>> from hookloop.control import ControlServer
>>> ControlServer(job_id="demo").job_id
'demo'
"""

from hookloop.control.client import ALIASES, ControlError, JobClient
from hookloop.control.registry import (
    JOBS_DIR_ENV,
    JobDir,
    JobRecord,
    RegistryError,
    find_job,
    jobs_dir,
    list_jobs,
)
from hookloop.control.server import (
    COMMANDS,
    SERVER_COMMANDS,
    Command,
    CommandError,
    ControlServer,
    TrainerControlCallback,
    parse_command,
    parse_request,
    register_command,
)

__all__ = [
    "ALIASES",
    "COMMANDS",
    "JOBS_DIR_ENV",
    "SERVER_COMMANDS",
    "Command",
    "CommandError",
    "ControlError",
    "ControlServer",
    "JobClient",
    "JobDir",
    "JobRecord",
    "RegistryError",
    "TrainerControlCallback",
    "find_job",
    "jobs_dir",
    "list_jobs",
    "parse_command",
    "parse_request",
    "register_command",
]
