// The dashboard's only script (the CSP allows no inline one): copy buttons, relative times,
// and keeping the timeline pinned to its newest item while the reader is at the bottom.
(function () {
  "use strict";

  function ago(when) {
    let seconds = Math.round((Date.now() - when.getTime()) / 1000);
    const future = seconds < 0;
    seconds = Math.abs(seconds);
    let text;
    if (seconds < 5) return future ? "now" : "just now";
    if (seconds < 60) text = seconds + " s";
    else if (seconds < 3600) text = Math.floor(seconds / 60) + " min";
    else if (seconds < 86400) text = Math.floor(seconds / 3600) + " h " + Math.floor((seconds % 3600) / 60) + " min";
    else text = Math.floor(seconds / 86400) + " d " + Math.floor((seconds % 86400) / 3600) + " h";
    return future ? "in " + text : text + " ago";
  }

  function refreshTimes(root) {
    (root || document).querySelectorAll("time[data-rel]").forEach(function (el) {
      const when = new Date(el.getAttribute("datetime"));
      if (!isNaN(when)) el.textContent = ago(when);
    });
  }

  function copy(text) {
    if (navigator.clipboard && window.isSecureContext) {
      return navigator.clipboard.writeText(text);
    }
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.className = "offscreen";
    document.body.appendChild(area);
    area.select();
    try { document.execCommand("copy"); } finally { area.remove(); }
    return Promise.resolve();
  }

  document.addEventListener("click", function (event) {
    const button = event.target.closest("[data-copy]");
    if (!button) return;
    event.preventDefault();
    copy(button.getAttribute("data-copy")).then(function () {
      button.classList.add("copied");
      button.setAttribute("data-copied", "copied");
      setTimeout(function () { button.classList.remove("copied"); }, 1200);
    }, function () { /* clipboard refused: nothing to do */ });
  });

  // The timeline follows new items only while the reader is looking at the newest ones.
  const pinned = new WeakMap();
  function atBottom(el) {
    return el.scrollHeight - el.scrollTop - el.clientHeight < 24;
  }
  document.addEventListener("htmx:oobBeforeSwap", function (event) {
    const box = event.detail.target && event.detail.target.closest("[data-stick-bottom]");
    if (box) pinned.set(box, atBottom(box));
  });
  document.addEventListener("htmx:oobAfterSwap", function (event) {
    const box = event.detail.target && event.detail.target.closest("[data-stick-bottom]");
    if (box && pinned.get(box)) box.scrollTop = box.scrollHeight;
  });
  document.addEventListener("htmx:load", function (event) { refreshTimes(event.target); });

  // A live update replaces a region whole; what the reader was doing in it survives: text
  // typed into its fields, the confirmation panel they opened, the field they were in.
  let pending = null;
  function fieldKey(el) { return el.name ? el.tagName + ":" + el.name : ""; }
  document.addEventListener("htmx:oobBeforeSwap", function (event) {
    const old = event.detail.target;
    if (!old || !old.querySelectorAll) return;
    const state = { values: {}, open: [], focus: "" };
    old.querySelectorAll("input[type=text], textarea").forEach(function (el) {
      if (el.value && fieldKey(el)) state.values[fieldKey(el)] = el.value;
    });
    old.querySelectorAll("details[open][data-keep]").forEach(function (el) {
      state.open.push(el.getAttribute("data-keep"));
    });
    if (document.activeElement && old.contains(document.activeElement)) {
      state.focus = fieldKey(document.activeElement);
    }
    pending = state;
  });
  document.addEventListener("htmx:oobAfterSwap", function (event) {
    const state = pending;
    pending = null;
    const box = event.detail.target && event.detail.target.id
      ? document.getElementById(event.detail.target.id) : null;
    if (!state || !box) return;
    state.open.forEach(function (name) {
      const el = box.querySelector("details[data-keep='" + name + "']");
      if (el) el.open = true;
    });
    box.querySelectorAll("input[type=text], textarea").forEach(function (el) {
      const value = state.values[fieldKey(el)];
      if (value !== undefined && !el.value) el.value = value;
      if (state.focus && fieldKey(el) === state.focus) el.focus();
    });
  });

  // The inspector follows the head while the reader only looks; once they open something
  // in it, it stays on its checkpoint (the next live update only changes its head mark).
  document.addEventListener("toggle", function (event) {
    const panel = event.target.closest && event.target.closest("#inspector");
    if (!panel || !event.target.open) return;
    const follow = panel.querySelector("input[name=follow]");
    if (follow) follow.value = "0";
  }, true);

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("[data-stick-bottom]").forEach(function (box) {
      box.scrollTop = box.scrollHeight;
    });
    refreshTimes();
    setInterval(refreshTimes, 5000);
  });

  // Say so when the server cannot be reached, instead of silently showing a stale page.
  document.addEventListener("htmx:sendError", function () {
    document.body.classList.add("offline");
  });
  document.addEventListener("htmx:afterRequest", function (event) {
    if (event.detail.successful || (event.detail.xhr && event.detail.xhr.status)) {
      document.body.classList.remove("offline");
    }
  });
})();
