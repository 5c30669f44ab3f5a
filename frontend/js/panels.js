// The panels that open over or beside the chat: the conversation list, the engine panel and
// the settings. Each opens and closes with its toggle button and its close button. Where a
// panel lies over the chat (the side panels on narrow screens, as drawers; the settings
// always), Esc closes it, the last opened first, and a scrim behind the drawers closes them
// on a click. On narrow screens one drawer is open at a time.

const panels = [];
const opened = []; // open panels, the last opened last
let scrim = null;

function syncScrim() {
  scrim.hidden = !panels.some((panel) => panel.open && panel.drawer && panel.overlays());
}

export class Panel {
  /**
   * `element`: the panel; `toggle` and `close`: its buttons; `overlayQuery`: the media query
   * under which it lies over the chat (null: always); `drawer`: a side panel (with the scrim);
   * `onShow(visible)`: after each change.
   */
  constructor({ element, toggle, close, overlayQuery = null, drawer = false, onShow = () => {} }) {
    this.element = element;
    this.toggle = toggle;
    this.overlayQuery = overlayQuery;
    this.drawer = drawer;
    this.onShow = onShow;
    panels.push(this);
    toggle.addEventListener("click", () => this.show(!this.open));
    close.addEventListener("click", () => this.show(false));
    // Back to a wide screen: a drawer is a side panel again, the scrim goes.
    overlayQuery?.addEventListener("change", syncScrim);
  }

  get open() {
    return !this.element.hidden;
  }

  overlays() {
    return this.overlayQuery === null || this.overlayQuery.matches;
  }

  show(visible, { focus = true } = {}) {
    this.element.hidden = !visible;
    this.toggle.setAttribute("aria-expanded", String(visible));
    const index = opened.indexOf(this);
    if (index >= 0) opened.splice(index, 1);
    if (visible) {
      opened.push(this);
      if (this.drawer && this.overlays()) {
        for (const other of panels) if (other !== this && other.drawer && other.open && other.overlays()) other.show(false, { focus: false });
      }
    }
    syncScrim();
    if (focus) {
      const target = visible ? this.element.querySelector("input, textarea, button:not(.close)") : this.toggle;
      target?.focus();
    }
    this.onShow(visible);
  }
}

/** Closes the last opened panel that lies over the chat: whether there was one (Esc). */
export function closeTopPanel() {
  const top = [...opened].reverse().find((panel) => panel.overlays());
  if (!top) return false;
  top.show(false);
  return true;
}

export function initPanels(scrimElement) {
  scrim = scrimElement;
  scrim.addEventListener("click", () => {
    for (const panel of panels) if (panel.drawer && panel.open && panel.overlays()) panel.show(false);
  });
}
