// lockstep chat page, the entry module: it wires the parts and starts the connection. Streaming chat runs over /ws
// (chat.js), Single and Batch over REST (tabs.js); the limits and error texts come from the server (config.js).
// The model's answers go through markdown.js (raw HTML shown as text, then sanitised); nothing builds HTML from
// strings. Native ES modules, no build step: each file below is served as it is.
import {onSocketDrop, onSocketMessage, restoreChat, wireChat} from "./chat.js";
import {showChatControls} from "./chat-view.js";
import {checkReadiness, loadModelCard, reconnect, startConnection} from "./connection.js";
import {wireSettings} from "./settings.js";
import {wireRestModes, wireTabs} from "./tabs.js";
import {$} from "./ui.js";

wireTabs();
wireChat();
wireRestModes();
wireSettings(reconnect);
startConnection({onMessage: onSocketMessage, onDrop: onSocketDrop, onConnectionChange: showChatControls});
restoreChat();
checkReadiness();
loadModelCard();
if (!matchMedia("(pointer: coarse)").matches) $("chat-input").focus();  // a phone would pop its keyboard up
