"""The gateway: an OpenAI-compatible server per session, for agents the library did not
write (the OpenAI Agents SDK, LangGraph, a team's own loop).

.. code-block:: python

    async with trio_rollouts.gateway.serve(inference, renderer) as gw:
        async with gw.session(problem) as session:  # session.base_url: .../sessions/<id>/v1
            await run_my_agent(session.base_url)  # unmodified: AsyncOpenAI(base_url=...)
        rollout = session.rollout(reward=1.0)  # a token-exact TokenRollout

See ``docs/gateway.md``.
"""

from trio_rollouts.gateway._agent import AgentCommandError as AgentCommandError
from trio_rollouts.gateway._agent import CommandTimeoutError as CommandTimeoutError
from trio_rollouts.gateway._agent import GatewayAgent as GatewayAgent
from trio_rollouts.gateway._asyncio import AsyncioCancelTimeoutError as AsyncioCancelTimeoutError
from trio_rollouts.gateway._gateway import Gateway as Gateway
from trio_rollouts.gateway._gateway import GatewaySession as GatewaySession
from trio_rollouts.gateway._gateway import serve as serve
from trio_rollouts.gateway._session import GatewayError as GatewayError
