"""Push-v0 / PushState-v0: a 6-joint arm with a flat paddle pushes a slider block to a target on a table.

Units: metres, seconds, radians. The table top is the plane z = 0, the arm's base stands at the origin
and works in front of it (+x). The model is ``push.xml`` next to this module (MuJoCo, timestep
0.002 s, implicitfast integrator).

Scene:
    arm: six hinge joints j1..j6 (base yaw, shoulder pitch, elbow pitch, wrist pitch, wrist roll, tool
        spin), gravity-compensated links, joint damping; each joint is driven by an ``intvelocity``
        actuator (the control is a joint velocity, integrated by MuJoCo into a position target clamped
        to the joint range, tracked by a stiff position servo), so joint limits always hold.
    paddle: a flat disc (radius ``PADDLE_RADIUS``, 0.03 m thick, axis along the tool) at the tool's
        end; the site ``"ee"`` is its centre. Only the paddle collides (with the block and the table).
    block: a 0.05 x 0.05 x 0.04 m box of 0.2 kg on three joints (slide x, slide y, hinge yaw) at table
        height; the table's friction is the joints' Coulomb frictionloss and viscous damping, so the
        block slides, turns, and never tips over or leaves the table top.
    target: a visual-only disc (a mocap body: its position is part of the MuJoCo state).

Episode (``reset``, randomised with ``self.np_random``): the arm starts at ``HOME_QPOS`` plus uniform
joint noise of +-``HOME_NOISE`` rad (the paddle near ``HOME_EE``, its axis vertical); the block's
centre is uniform in ``BLOCK_REGION`` with a uniform yaw, the target uniform in the same region at a
distance in ``TARGET_DISTANCE`` from the block (rejection sampling), all well within the arm's reach.
The instruction is one of ``INSTRUCTIONS``, uniformly.

Action (float32 [3], Box [-MAX_EE_SPEED, MAX_EE_SPEED] m/s; clipped, NaN counts as 0): the paddle's
Cartesian velocity (vx, vy, vz) in the world frame, held for ``CONTROL_PERIOD`` = 0.1 s (10 Hz,
``N_SUBSTEPS`` physics steps). Soft workspace clamp (:func:`workspace_velocity`): the velocity is
changed so that the commanded point ``ee + T v`` stays in the workspace, a cylindrical sector about
the base's axis (radius in ``EE_RADIUS_RANGE``, azimuth within +-``EE_MAX_AZIMUTH``) with the height
in ``EE_Z_RANGE``; in particular ``vz <- clip(vz, (z_lo - z) / T, (z_hi - z) / T)``, so the paddle
stays near pushing height and cannot be driven into the table or lifted away, nor the arm stretched
into its singular reach boundary. The command becomes joint velocities by damped least squares on the site Jacobian (``mj_jacSite``),
``dq = J^T (J J^T + IK_DAMPING^2 I)^-1 xdot``, where J stacks the 3 rows of the positional Jacobian
and the x, y rows of the rotational one, and ``xdot = (v, w_xy)`` with ``w = TILT_GAIN * (z_ee x e_z)``
holding the paddle's axis vertical (the spin about the vertical axis is free: the paddle is round).
``dq`` (clipped to +-3 rad/s) is the actuators' control for the period; the integrated position
targets are kept within ``TARGET_LEASH`` rad of the joint angles so a blocked arm does not wind up.

Observation:
    Push-v0, a Dict:
        "top": uint8 [128, 128, 3] RGB, camera 0.95 m above the table looking down.
        "side": uint8 [128, 128, 3] RGB, camera at 45 degrees elevation opposite the arm.
        "proprio": float32 [16]: joint angles j1..j6 (rad), joint velocities (rad/s), block centre
            xy (m), target xy (m).
        "instruction": str (gymnasium Text), e.g. "push the block to the target".
    PushState-v0, a Box float32 [21] (``STATE_LAYOUT``): proprio (16) as above, then the paddle's
        centre xyz (3, m), then sin and cos of the block's yaw (2). Nothing is ever rendered (the
        MuJoCo renderer is not created unless ``render_mode="rgb_array"`` and ``render()`` is called).

Reward per step (metres, plus a bonus):
    ``-(|ee - block| + TARGET_WEIGHT * |block_xy - target_xy|) + SUCCESS_BONUS * success``,
    with ``|ee - block|`` the 3-D distance from the paddle's centre to the block's centre, measured
    after the step. Success: the block's centre within ``SUCCESS_RADIUS`` (0.03 m, horizontal) of the
    target; it terminates the episode. ``MAX_STEPS`` = 100 control steps (10 s) truncate it (the
    registered TimeLimit). ``info["is_success"]`` (bool) and ``info["block_to_target"]`` (m) every step.

Rendering needs a headless OpenGL: importing this module sets ``MUJOCO_GL`` (when unset) to "egl" if
an EGL device display can be initialised, else to "osmesa" if libOSMesa is installed (``GL_BACKEND``
says which). If mujoco was imported earlier with ``MUJOCO_GL`` unset (torchrl.envs imports it) and
there is no display, the renderers are built with an EGL (else OSMesa) context all the same
(:func:`gl_backend` says which is used). A renderer that cannot be created raises
:class:`rlfunc.errors.EnvError` naming what to install.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import importlib
import os
import string
import sys
import weakref
from pathlib import Path


def _egl_display_works() -> bool:
    """Whether libEGL loads and initialises a device display, as MuJoCo's EGL backend needs (ctypes only)."""
    try:
        egl = ctypes.CDLL(ctypes.util.find_library("EGL") or "libEGL.so.1")
    except OSError:
        return False
    try:
        get_proc = egl.eglGetProcAddress
        get_proc.restype, get_proc.argtypes = ctypes.c_void_p, [ctypes.c_char_p]
        query_ptr, display_ptr = get_proc(b"eglQueryDevicesEXT"), get_proc(b"eglGetPlatformDisplayEXT")
        if not query_ptr or not display_ptr:
            return False
        query = ctypes.CFUNCTYPE(ctypes.c_uint, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int))(query_ptr)
        get_display = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p)(display_ptr)
        egl.eglInitialize.restype, egl.eglInitialize.argtypes = ctypes.c_uint, [ctypes.c_void_p] * 3
        egl.eglTerminate.restype, egl.eglTerminate.argtypes = ctypes.c_uint, [ctypes.c_void_p]
        devices, count = (ctypes.c_void_p * 8)(), ctypes.c_int(0)
        if not query(8, devices, ctypes.byref(count)):
            return False
        for i in range(count.value):
            display = get_display(0x313F, devices[i], None)  # EGL_PLATFORM_DEVICE_EXT
            if display and egl.eglInitialize(display, None, None):
                egl.eglTerminate(display)
                return True
    except (AttributeError, OSError):
        return False
    return False


def _pick_gl_backend(egl_works: bool, osmesa_found: bool, has_display: bool) -> str:
    """The MUJOCO_GL value to set: "egl", else "osmesa", else "" (mujoco's default, GLFW) with a
    display, else "disable" (import works, rendering raises EnvError)."""
    if egl_works:
        return "egl"
    if osmesa_found:
        return "osmesa"
    return "" if has_display else "disable"


def _choose_gl_backend() -> str:
    """Set ``MUJOCO_GL`` before mujoco is imported, when the user has not: "egl", else "osmesa".

    Returns the backend mujoco will use ("" for its default). When mujoco is already imported the
    choice has been made and is only reported. With neither backend and no display, MUJOCO_GL is set
    to "disable" so that ``import mujoco`` (and PushState-v0) still work; rendering then raises EnvError.
    """
    chosen = os.environ.get("MUJOCO_GL", "")
    if chosen or "mujoco" in sys.modules:
        return chosen
    egl = _egl_display_works()
    osmesa = not egl and ctypes.util.find_library("OSMesa") is not None
    chosen = _pick_gl_backend(egl, osmesa, bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")))
    if chosen:
        os.environ["MUJOCO_GL"] = chosen
        if chosen in ("egl", "osmesa"):
            os.environ.setdefault("PYOPENGL_PLATFORM", chosen)
    return chosen


_MUJOCO_IMPORTED_BEFORE = "mujoco" in sys.modules  # then MUJOCO_GL could not be chosen here
GL_BACKEND = _choose_gl_backend()

import gymnasium as gym  # noqa: E402  (after MUJOCO_GL is set)
import numpy as np  # noqa: E402

from rlfunc.errors import EnvError  # noqa: E402

try:
    import mujoco  # noqa: E402
except Exception as e:  # a MUJOCO_GL backend whose library is missing fails inside PyOpenGL (AttributeError, ImportError ...)
    raise EnvError(
        f"mujoco cannot be imported with MUJOCO_GL={os.environ.get('MUJOCO_GL', '') or 'unset'} "
        f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}); install that backend "
        "(egl: apt-get install libegl1 libgl1-mesa-dri; osmesa: apt-get install libosmesa6) or unset MUJOCO_GL"
    ) from e

XML_PATH = Path(__file__).with_name("push.xml")
CONTROL_PERIOD = 0.1  # s per env step (10 Hz)
N_SUBSTEPS = 50  # physics steps per env step (CONTROL_PERIOD / timestep 0.002 s)
MAX_EE_SPEED = 0.25  # m/s, bound of every action component
EE_Z_RANGE = (0.03, 0.15)  # m, workspace: paddle-centre height (table top z = 0)
EE_RADIUS_RANGE = (0.15, 0.60)  # m, workspace: paddle-centre distance from the base's (vertical) axis
EE_MAX_AZIMUTH = 1.0  # rad, workspace: |atan2(y, x)| of the paddle centre
IK_DAMPING = 0.05  # lambda of the damped least squares (m/s-scale units)
TILT_GAIN = 5.0  # 1/s, angular velocity per radian of paddle-axis tilt
MAX_JOINT_SPEED = 3.0  # rad/s, the actuators' control range
TARGET_LEASH = 0.15  # rad, max distance of a joint's integrated position target from its angle
HOME_QPOS = np.array([0.0, -0.8480416, 2.4240411, -1.5759995, 0.0, 0.0])  # rad: paddle at HOME_EE, axis vertical
HOME_EE = np.array([0.25, 0.0, 0.08])  # m
HOME_NOISE = 0.03  # rad, uniform noise added to HOME_QPOS at reset
BLOCK_REGION = ((0.36, 0.48), (-0.14, 0.14))  # m, (x range, y range) of block centre and target
TARGET_DISTANCE = (0.10, 0.22)  # m, range of the initial block-target distance
BLOCK_HALF = 0.025  # m, half the block's side
BLOCK_HEIGHT = 0.04  # m
PADDLE_RADIUS = 0.03  # m
SUCCESS_RADIUS = 0.03  # m, block centre to target (horizontal) at success
SUCCESS_BONUS = 10.0  # reward added on the success step
TARGET_WEIGHT = 2.0  # weight of the block-target distance in the dense reward
MAX_STEPS = 100  # control steps per episode (registered max_episode_steps)
IMAGE_SIZE = 128  # px, side of the camera observations
RENDER_SIZE = 256  # px, side of ``render()`` frames (side camera)
CAMERAS = ("top", "side")
INSTRUCTIONS = (
    "push the block to the target",
    "slide the red block onto the green target",
    "move the block to the green marker",
    "push the red cube to the goal",
    "nudge the block until it reaches the target",
)
INSTRUCTION_CHARSET = string.ascii_letters + string.digits + " ,.'-"
PROPRIO_DIM = 16
STATE_DIM = 21
STATE_LAYOUT = {  # slices of the PushState-v0 observation
    "joint_angle": slice(0, 6),
    "joint_velocity": slice(6, 12),
    "block_xy": slice(12, 14),
    "target_xy": slice(14, 16),
    "ee_xyz": slice(16, 19),
    "block_yaw_sin_cos": slice(19, 21),
}


def workspace_velocity(ee: np.ndarray, velocity: np.ndarray) -> np.ndarray:
    """The soft workspace clamp: ``velocity`` changed so the commanded point stays in the workspace.

    The commanded point ``p = ee + CONTROL_PERIOD * velocity`` is moved into the workspace by clamping
    its cylindrical coordinates about the base's axis independently: radius ``|p_xy|`` to
    ``EE_RADIUS_RANGE``, azimuth ``atan2(p_y, p_x)`` to +-``EE_MAX_AZIMUTH``, height ``p_z`` to
    ``EE_Z_RANGE``; the result is ``(p' - ee) / CONTROL_PERIOD`` clipped to +-MAX_EE_SPEED per axis.
    Inside the workspace nothing changes; at its boundary the component pushing out is removed.

    Args:
        ee: [3] float, the paddle centre, m.
        velocity: [3] float, the commanded paddle velocity, m/s.

    Returns:
        [3] float64, m/s.
    """
    p = np.asarray(ee, dtype=np.float64) + CONTROL_PERIOD * np.asarray(velocity, dtype=np.float64)
    r = np.clip(np.hypot(p[0], p[1]), *EE_RADIUS_RANGE)
    azimuth = np.clip(np.arctan2(p[1], p[0]), -EE_MAX_AZIMUTH, EE_MAX_AZIMUTH)
    clamped = np.array([r * np.cos(azimuth), r * np.sin(azimuth), np.clip(p[2], *EE_Z_RANGE)])
    return np.clip((clamped - ee) / CONTROL_PERIOD, -MAX_EE_SPEED, MAX_EE_SPEED)


_LIVE_RENDERERS: weakref.WeakSet = weakref.WeakSet()  # envs holding renderers, closed at exit
_EXIT_HOOK = []  # [True] once _close_live_renderers is registered with atexit


def _close_live_renderers() -> None:
    for env in list(_LIVE_RENDERERS):
        env._close_renderers()


_LATE_CONTEXT: list = []  # [GLContext class or None], decided on the first renderer


def _late_context_class():
    """The EGL (or OSMesa) GLContext class for mujoco imported before this module with its default
    GLFW backend and no display (e.g. by torchrl.envs), or None when that does not apply or neither
    works. PyOpenGL must not be bound to another platform yet."""
    if not _LATE_CONTEXT:
        context = None
        headless = not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
        platform = os.environ.get("PYOPENGL_PLATFORM", "")
        if _MUJOCO_IMPORTED_BEFORE and not os.environ.get("MUJOCO_GL") and headless and ("OpenGL" not in sys.modules or platform):
            egl = _egl_display_works()
            backend = "egl" if egl else "osmesa" if ctypes.util.find_library("OSMesa") else ""
            if backend and platform in ("", backend):
                os.environ["PYOPENGL_PLATFORM"] = backend
                try:
                    context = importlib.import_module(f"mujoco.{backend}").GLContext
                except Exception:  # the backend's Python side fails to load: keep mujoco's default
                    context = None
        _LATE_CONTEXT.append(context)
    return _LATE_CONTEXT[0]


def gl_backend() -> str:
    """The OpenGL backend Push-v0's renderers use: "egl", "osmesa", "glfw", or "disable"."""
    late = _late_context_class() if _MUJOCO_IMPORTED_BEFORE else None
    if late is not None:
        return late.__module__.rsplit(".", 1)[-1]
    chosen = os.environ.get("MUJOCO_GL", "") or "glfw"
    return "disable" if chosen in ("disable", "disabled", "off", "false", "0") else chosen


def rendering_available() -> bool:
    """Whether Push-v0 can render here (one env is made, reset and closed; the answer is cached)."""
    if not _RENDERING:
        try:
            env = PushEnv()
            env.reset(seed=0)
            env.close()
            _RENDERING.append(True)
        except EnvError:
            _RENDERING.append(False)
    return _RENDERING[0]


_RENDERING: list[bool] = []  # rendering_available's answer, once asked


def _make_renderer(model: mujoco.MjModel, size: int) -> mujoco.Renderer:
    """A mujoco.Renderer of ``size`` x ``size`` px, or EnvError with what to install.

    When mujoco was imported before this module with MUJOCO_GL unset and there is no display, the
    renderer is built with an EGL (else OSMesa) context instead of GLFW's (mujoco's module-level
    choice is swapped for the construction only)."""
    if gl_backend() == "disable":  # no context to build: a half-built Renderer's __del__ printed a traceback after the error
        raise EnvError(f"Push-v0 cannot render (MUJOCO_GL={os.environ.get('MUJOCO_GL')}: rendering disabled); unset it or set "
                       "MUJOCO_GL=egl (or osmesa) with headless OpenGL installed, or use PushState-v0, which never renders")
    late = _late_context_class() if _MUJOCO_IMPORTED_BEFORE else None
    try:
        if late is None:
            return mujoco.Renderer(model, size, size)
        default, mujoco.gl_context.GLContext = mujoco.gl_context.GLContext, late
        try:
            return mujoco.Renderer(model, size, size)
        finally:
            mujoco.gl_context.GLContext = default
    except Exception as e:  # GL context creation raises many types (ImportError, RuntimeError, GLError ...)
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        gl = os.environ.get("MUJOCO_GL", "") or "unset"
        early = (
            "mujoco was imported before envs.push.env, so set MUJOCO_GL=egl (or osmesa) in the environment, or "
            if _MUJOCO_IMPORTED_BEFORE and gl == "unset"
            else ""
        )
        raise EnvError(
            f"Push-v0 cannot render (MUJOCO_GL={gl}: {detail}); {early}install headless OpenGL, EGL "
            "(apt-get install libegl1 libgl1-mesa-dri) or OSMesa (apt-get install libosmesa6, with "
            "MUJOCO_GL=osmesa), or use PushState-v0, which never renders"
        ) from e


class PushEnv(gym.Env):
    """Push-v0: pixels (two cameras), proprioception and a language instruction; see the module docstring.

    Args:
        render_mode: None or "rgb_array" (``render()`` returns the side camera, uint8 [256, 256, 3]).

    Raises:
        EnvError: an unknown ``render_mode``; on reset/step/render, no working OpenGL for the cameras.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": round(1.0 / CONTROL_PERIOD)}

    def __init__(self, render_mode: str | None = None):
        if render_mode not in (None, "rgb_array"):
            raise EnvError(f"render_mode={render_mode!r}: expected None or 'rgb_array'")
        self.render_mode = render_mode
        self.model = mujoco.MjModel.from_xml_path(str(XML_PATH))
        self.data = mujoco.MjData(self.model)
        m = self.model
        joint = lambda name: mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_JOINT, name)  # noqa: E731
        arm = np.array([joint(f"j{i}") for i in range(1, 7)])
        block = np.array([joint(name) for name in ("block_x", "block_y", "block_yaw")])
        self._site = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_SITE, "ee")
        self._arm_dofs, self._arm_qpos = m.jnt_dofadr[arm], m.jnt_qposadr[arm]
        self._block_qpos = m.jnt_qposadr[block]
        self._block_origin = m.body_pos[mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_BODY, "block")].copy()
        self._joint_range = m.jnt_range[arm].copy()  # [6, 2] rad
        if abs(m.opt.timestep * N_SUBSTEPS - CONTROL_PERIOD) > 1e-9:
            raise EnvError(f"push.xml timestep {m.opt.timestep}: expected {CONTROL_PERIOD / N_SUBSTEPS}")
        self._jacp = np.zeros((3, m.nv))
        self._jacr = np.zeros((3, m.nv))
        self._renderer: mujoco.Renderer | None = None
        self._frame_renderer: mujoco.Renderer | None = None
        self.action_space = gym.spaces.Box(-MAX_EE_SPEED, MAX_EE_SPEED, shape=(3,), dtype=np.float32)
        self.observation_space = self._make_observation_space()

    def _make_observation_space(self) -> gym.spaces.Space:
        image = gym.spaces.Box(0, 255, shape=(IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
        return gym.spaces.Dict(
            {
                "top": image,
                "side": image,
                "proprio": gym.spaces.Box(-np.inf, np.inf, shape=(PROPRIO_DIM,), dtype=np.float32),
                "instruction": gym.spaces.Text(max_length=64, min_length=1, charset=INSTRUCTION_CHARSET),
            }
        )

    # -- true state, read by the reward, the observation and the scripted expert ------------------

    @property
    def ee_position(self) -> np.ndarray:
        """[3] float64, the paddle centre (site "ee") in the world frame, m."""
        return self.data.site_xpos[self._site].copy()

    @property
    def block_position(self) -> np.ndarray:
        """[2] float64, the block centre's xy, m."""
        return self._block_origin[:2] + self.data.qpos[self._block_qpos[:2]]

    @property
    def block_yaw(self) -> float:
        """The block's yaw about the vertical, rad (unwrapped)."""
        return float(self.data.qpos[self._block_qpos[2]])

    @property
    def target_position(self) -> np.ndarray:
        """[2] float64, the target's xy, m."""
        return self.data.mocap_pos[0, :2].copy()

    @property
    def instruction(self) -> str:
        """This episode's instruction (its index is kept in the MuJoCo state, ``data.userdata[0]``)."""
        return INSTRUCTIONS[int(self.data.userdata[0])]

    def is_success(self) -> bool:
        """Whether the block's centre is within SUCCESS_RADIUS of the target (horizontally)."""
        return bool(np.linalg.norm(self.block_position - self.target_position) <= SUCCESS_RADIUS)

    # -- gymnasium API --------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        m, d, rng = self.model, self.data, self.np_random
        mujoco.mj_resetData(m, d)
        q = HOME_QPOS + rng.uniform(-HOME_NOISE, HOME_NOISE, size=6)
        q = np.clip(q, self._joint_range[:, 0], self._joint_range[:, 1])
        d.qpos[self._arm_qpos] = q
        d.act[:] = q  # the actuators' position targets start at the joint angles
        (x0, x1), (y0, y1) = BLOCK_REGION
        block = rng.uniform((x0, y0), (x1, y1))
        while True:
            target = rng.uniform((x0, y0), (x1, y1))
            if TARGET_DISTANCE[0] <= np.linalg.norm(target - block) <= TARGET_DISTANCE[1]:
                break
        d.qpos[self._block_qpos] = (*(block - self._block_origin[:2]), rng.uniform(-np.pi, np.pi))
        d.mocap_pos[0, :2] = target
        d.userdata[0] = rng.integers(len(INSTRUCTIONS))
        mujoco.mj_forward(m, d)
        return self._observation(), {"is_success": self.is_success(), "block_to_target": self._block_to_target()}

    def step(self, action):
        m, d = self.model, self.data
        v = np.nan_to_num(np.asarray(action, dtype=np.float64).reshape(3), nan=0.0)
        v = np.clip(v, -MAX_EE_SPEED, MAX_EE_SPEED)
        d.ctrl[:] = self.joint_velocity_command(workspace_velocity(d.site_xpos[self._site], v))
        q = d.qpos[self._arm_qpos]
        d.act[:] = np.clip(d.act, q - TARGET_LEASH, q + TARGET_LEASH)
        mujoco.mj_step(m, d, nstep=N_SUBSTEPS)
        # positions and the Jacobian's inputs for the observation, the reward and the next step
        mujoco.mj_kinematics(m, d)
        mujoco.mj_comPos(m, d)
        success = self.is_success()
        reward = -(self._ee_to_block() + TARGET_WEIGHT * self._block_to_target()) + (SUCCESS_BONUS if success else 0.0)
        info = {"is_success": success, "block_to_target": self._block_to_target()}
        return self._observation(), float(reward), success, False, info

    def joint_velocity_command(self, ee_velocity: np.ndarray) -> np.ndarray:
        """Joint velocities (rad/s, [6], clipped to +-MAX_JOINT_SPEED) moving the paddle at ``ee_velocity``.

        Damped least squares, ``dq = J^T (J J^T + IK_DAMPING^2 I)^-1 xdot``, on the stacked Jacobian
        of the site "ee" (3 positional rows, the rotational x and y rows) at the current state, with
        ``xdot = (ee_velocity, TILT_GAIN * (z_ee x e_z)_xy)`` keeping the paddle's axis vertical.

        Args:
            ee_velocity: [3] float, the paddle's world-frame velocity, m/s (no clipping here).
        """
        m, d = self.model, self.data
        mujoco.mj_jacSite(m, d, self._jacp, self._jacr, self._site)
        jac = np.concatenate([self._jacp[:, self._arm_dofs], self._jacr[:2, self._arm_dofs]])  # [5, 6]
        axis = d.site_xmat[self._site].reshape(3, 3)[:, 2]
        tilt = np.cross(axis, (0.0, 0.0, 1.0))
        xdot = np.concatenate([ee_velocity, TILT_GAIN * tilt[:2]])
        dq = jac.T @ np.linalg.solve(jac @ jac.T + IK_DAMPING**2 * np.eye(5), xdot)
        return np.clip(dq, -MAX_JOINT_SPEED, MAX_JOINT_SPEED)

    def render(self):
        if self.render_mode != "rgb_array":
            return None
        if self._frame_renderer is None:
            self._frame_renderer = _make_renderer(self.model, RENDER_SIZE)
            self._register_renderers()
        self._frame_renderer.update_scene(self.data, camera="side")
        return self._frame_renderer.render()

    def close(self):
        self._close_renderers()
        super().close()

    # -- internals ------------------------------------------------------------------------------

    def _register_renderers(self) -> None:
        if not _EXIT_HOOK:
            # after mujoco's own EGL atexit hook (registered when its first context was made), so
            # this runs first: renderers are freed before the display is terminated
            atexit.register(_close_live_renderers)
            _EXIT_HOOK.append(True)
        _LIVE_RENDERERS.add(self)

    def _close_renderers(self) -> None:
        for name in ("_renderer", "_frame_renderer"):
            renderer = getattr(self, name, None)
            if renderer is not None:
                renderer.close()
                setattr(self, name, None)

    def _ee_to_block(self) -> float:
        block = np.array([*self.block_position, BLOCK_HEIGHT / 2])
        return float(np.linalg.norm(self.data.site_xpos[self._site] - block))

    def _block_to_target(self) -> float:
        return float(np.linalg.norm(self.block_position - self.target_position))

    def _proprio(self) -> np.ndarray:
        d = self.data
        return np.concatenate(
            [d.qpos[self._arm_qpos], d.qvel[self._arm_dofs], self.block_position, self.target_position]
        ).astype(np.float32)

    def _images(self) -> dict[str, np.ndarray]:
        if self._renderer is None:
            self._renderer = _make_renderer(self.model, IMAGE_SIZE)
            self._register_renderers()
        images = {}
        for camera in CAMERAS:
            self._renderer.update_scene(self.data, camera=camera)
            images[camera] = self._renderer.render()
        return images

    def _observation(self):
        return {**self._images(), "proprio": self._proprio(), "instruction": self.instruction}


class PushStateEnv(PushEnv):
    """PushState-v0: the same task with a float32 [21] state observation (``STATE_LAYOUT``), never rendering."""

    def _make_observation_space(self) -> gym.spaces.Space:
        return gym.spaces.Box(-np.inf, np.inf, shape=(STATE_DIM,), dtype=np.float32)

    def _observation(self):
        yaw = self.block_yaw
        extra = np.array([*self.data.site_xpos[self._site], np.sin(yaw), np.cos(yaw)])
        return np.concatenate([self._proprio(), extra.astype(np.float32)])
